"""Bounded latency windows and the exporter's incremental histograms."""

import pytest

from k3.serve.metrics import SampleWindow, _Histogram


def test_window_keeps_the_last_samples_and_counts_all():
    w = SampleWindow(maxlen=3)
    for v in range(5):
        w.append(float(v))
    assert list(w) == [2.0, 3.0, 4.0] and w.total == 5 and len(w) == 3
    assert w.since(0) == [2.0, 3.0, 4.0]  # 0 and 1 were dropped
    assert w.since(3) == [3.0, 4.0] and w.since(5) == []
    with pytest.raises(ValueError, match="maxlen"):
        SampleWindow(0)


def test_histogram_folds_each_sample_once_across_scrapes():
    w, h = SampleWindow(maxlen=4), _Histogram((0.1, 1.0))
    for v in (0.05, 0.5):
        w.append(v)
    h.update(w)
    for v in (2.0, 0.05, 0.5):
        w.append(v)
    h.update(w)
    h.update(w)  # nothing new
    assert h.counts == [2, 2, 1] and h.seen == 5 and h.sum == pytest.approx(3.1)
