"""Checkpoints whose index or config.json is malformed are refused with a message naming the file and the
problem (through the API and the CLI); saves fsync everything before the rename; shard digests are recorded
and checked on load."""

import hashlib
import json
import os
import struct

import pytest
import torch

from k3.checkpoint import CheckpointError, from_pretrained, save_pretrained
from k3.cli import main
from k3.config import K3Config
from k3.model.model import K3ForCausalLM

INDEX = "model.safetensors.index.json"


def _cfg():
    return K3Config.from_preset("tiny").replace(vocab_size=512, num_nextn_predict_layers=0, eos_token_id=0,
                                                pad_token_id=0)


def _save(path, max_shard_bytes=4 << 30, seed=0):
    from k3.data.tokenizer import byte_level_tokenizer

    model = K3ForCausalLM(_cfg()).init_weights(seed=seed)
    tok = byte_level_tokenizer(512).to_str().encode("utf-8")
    save_pretrained(model, path, max_shard_bytes=max_shard_bytes, extra_files={"tokenizer.json": tok})
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "ck"
    _save(path)
    return path


@pytest.fixture
def ck(saved, tmp_path):
    import shutil

    dst = tmp_path / "ck"
    shutil.copytree(saved, dst)
    return dst


def _cli_error(capsys, argv):
    """Run the CLI; returns (exit code, stderr lines)."""
    capsys.readouterr()
    rc = main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# --- malformed index --------------------------------------------------------------------------------------
SHARD = "model-00001-of-000001.safetensors"
BAD_INDEXES = [
    (b'{"weight_map": 5}', "'weight_map' = 5"),
    (b'{"weight_map": {"a": 3}}', "'weight_map'['a'] = 3"),
    (b"[]", "top level is a JSON list"),
    (b"\xff\xfe{\x00", "not UTF-8"),
    (b'{"weight_map": ', "not valid JSON"),
    (b'{"metadata": {}}', "'weight_map' is missing"),
    (b'{"weight_map": {}}', "'weight_map' = {}"),
    (b'{"weight_map": {"a": "../../etc/passwd.safetensors"}}', "../../etc/passwd.safetensors"),
    (b'{"weight_map": {"a": "/abs/x.safetensors"}}', "/abs/x.safetensors"),
    (b'{"weight_map": {"a": "' + SHARD.encode() + b'"}, "shards": 1}', "unknown keys ['shards']"),
    (b'{"weight_map": {"a": "' + SHARD.encode() + b'"}, "metadata": 3}', "'metadata' = 3"),
    (b'{"weight_map": {"a": "' + SHARD.encode() + b'"}, "metadata": {"total_size": "big"}}', "total_size"),
    (b'{"weight_map": {"a": "' + SHARD.encode() + b'"}, "metadata": {"k3_sha256": []}}', "k3_sha256"),
    (b'{"weight_map": {"a": "' + SHARD.encode() + b'"}, "metadata": {"k3_sha256": {"' + SHARD.encode()
     + b'": "xyz"}}}', "64 lowercase hex"),
    (b'{"weight_map": {"a": "' + SHARD.encode() + b'"}, "metadata": {"k3_sha256": {"other.safetensors": "'
     + b"0" * 64 + b'"}}}', "not a shard of 'weight_map'"),
]


@pytest.mark.parametrize("content, problem", BAD_INDEXES)
def test_malformed_index_is_named_through_the_api(ck, content, problem):
    (ck / INDEX).write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        from_pretrained(ck)
    assert str(ck / INDEX) in str(e.value) and problem in str(e.value)


@pytest.mark.parametrize("content, problem", BAD_INDEXES[:4])
def test_malformed_index_is_one_line_and_exit_2_from_eval_and_generate(ck, capsys, content, problem):
    (ck / INDEX).write_bytes(content)
    for cmd in (["eval", "--ckpt", str(ck)], ["generate", "--ckpt", str(ck), "x"]):
        rc, err = _cli_error(capsys, cmd + ["--device", "cpu"])
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"k3 {cmd[0]}: ") and INDEX in err[0] and problem in err[0]


def test_malformed_index_from_serve(ck, capsys):
    pytest.importorskip("uvicorn")
    (ck / INDEX).write_bytes(b'{"weight_map": 5}')
    rc, err = _cli_error(capsys, ["serve", "--ckpt", str(ck), "--device", "cpu", "--port", "0"])
    assert rc == 2 and len(err) == 1 and err[0].startswith("k3 serve: ") and INDEX in err[0], err


# --- malformed config.json ----------------------------------------------------------------------------------
def _edit_config(ck, fn):
    d = json.loads((ck / "config.json").read_text())
    fn(d)
    (ck / "config.json").write_text(json.dumps(d))


def _set(key, value):
    return lambda d: d["text_config"].update({key: value})


def _set_lac(key, value):
    return lambda d: d["text_config"]["linear_attn_config"].update({key: value})


def _delete(key):
    return lambda d: d["text_config"].pop(key)


BAD_CONFIGS = [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{\x00", "not UTF-8"),
    (b"[]", "must be a JSON object"),
    (_set("hidden_size", "x"), "'hidden_size' = 'x'"),
    (_set_lac("kda_layers", ["a"]), "'kda_layers'"),
    (_set_lac("kda_layers", 3), "'kda_layers'"),
    (_delete("hidden_size"), "lacks required keys text_config.hidden_size"),
    (lambda d: d["text_config"].pop("linear_attn_config"), "linear_attn_config.kda_layers"),
    (lambda d: d["text_config"].update(num_hidden_layer=d["text_config"].pop("num_hidden_layers")),
     "'text_config.num_hidden_layer' is unknown: did you mean 'num_hidden_layers'"),
    (_set("rms_norm_eps", -1.0), "'rms_norm_eps' = -1.0"),
    (_set("quantization_config", 5), "'quantization_config' = 5"),
    (lambda d: d.update(text_config=[1, 2]), "'text_config' must be a JSON object"),
]


@pytest.mark.parametrize("change, problem", BAD_CONFIGS)
def test_malformed_config_is_named(ck, capsys, change, problem):
    if isinstance(change, bytes):
        (ck / "config.json").write_bytes(change)
    else:
        _edit_config(ck, change)
    with pytest.raises(CheckpointError) as e:
        from_pretrained(ck)
    assert str(ck / "config.json") in str(e.value) and problem in str(e.value)
    rc, err = _cli_error(capsys, ["eval", "--ckpt", str(ck), "--device", "cpu"])
    assert rc == 2 and len(err) == 1 and err[0].startswith("k3 eval: ") and problem in err[0], err


def test_release_config_with_transformers_noise_still_loads():
    # The release's config.json carries transformers' generic fields (max_length, id2label, head_dim, ...):
    # unknown, but no misspelling of ours, so they are ignored even in strict mode.
    c = K3Config.from_preset("k3")
    d = c.to_dict()
    d["text_config"].update(max_length=20, top_k=50, num_beams=1, id2label={"0": "LABEL_0"}, head_dim=74,
                            transformers_version="4.56.2", use_cache=True, rope_theta=10000.0)
    d.update(transformers_version="4.56.2", auto_map={"AutoConfig": "configuration_kimi_k3.KimiK3Config"},
             image_placeholder="<|kimi_image_placeholder|>")
    assert K3Config.from_dict(d, strict=True) == c


def test_partial_config_files_stay_accepted_outside_checkpoints(tmp_path):
    # `k3 train --config` and `k3 info` read hand-written configs: missing keys take the release values there.
    (tmp_path / "c.json").write_text(json.dumps({"hidden_size": 7168}))
    assert K3Config.load(tmp_path / "c.json") == K3Config()


# --- fsync ---------------------------------------------------------------------------------------------
def _record_sync(monkeypatch):
    """Record ('fsync', path) for every os.fsync and ('replace', src, dst) for every os.replace, in order."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="maps descriptors to paths through /proc")
def test_every_file_and_the_directories_are_synced_around_the_rename(tmp_path, monkeypatch):
    model = K3ForCausalLM(_cfg()).init_weights(seed=0)
    events = _record_sync(monkeypatch)
    dst = str(tmp_path / "ck")
    save_pretrained(model, dst, max_shard_bytes=4 << 20, extra_files={"tokenizer.json": b"{}", "x.json": b"{}"})
    renames = [i for i, e in enumerate(events) if e == ("replace", dst + ".partial", dst)]
    assert len(renames) == 1
    before = {e[1] for e in events[: renames[0]] if e[0] == "fsync"}
    after = {e[1] for e in events[renames[0]:] if e[0] == "fsync"}
    # shards are synced under a temporary name and renamed inside the staging directory (their final names hold
    # the shard count); the directory is synced after those renames, before its own
    inner = {e[2]: e[1] for e in events[: renames[0]] if e[0] == "replace"}
    dir_sync = max(i for i, e in enumerate(events[: renames[0]]) if e == ("fsync", dst + ".partial"))
    assert all(i < dir_sync for i, e in enumerate(events) if e[0] == "replace" and e[2] in inner)
    files = sorted(os.listdir(dst))
    assert len([f for f in files if f.endswith(".safetensors")]) > 1  # several shards
    assert {"config.json", INDEX, "tokenizer.json", "x.json"} <= set(files)
    for f in files:
        staged = os.path.join(dst + ".partial", f)
        assert inner.get(staged, staged) in before, f
    assert dst + ".partial" in before  # the directory's entries
    assert str(tmp_path) in after  # the rename itself


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="maps descriptors to paths through /proc")
def test_atomic_write_syncs_the_file_then_the_directory_after_the_rename(tmp_path, monkeypatch):
    from k3.files import atomic_write_text

    events = _record_sync(monkeypatch)
    atomic_write_text(tmp_path / "latest.json", "{}")
    kinds = [(e[0], os.path.basename(e[-1])) for e in events]
    assert kinds[0][0] == "fsync" and kinds[0][1].startswith(".tmp-")  # the data, before the rename
    assert kinds[1] == ("replace", "latest.json")
    assert events[2] == ("fsync", str(tmp_path))
    assert (tmp_path / "latest.json").read_text() == "{}"


# --- shard digests -----------------------------------------------------------------------------------------
def _flip_data_byte(shard, offset_in_data=1000):
    """Flip one byte inside the tensor data (after the 8-byte length and the JSON header)."""
    b = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", b[:8])
    b[8 + n + offset_in_data] ^= 0xFF
    shard.write_bytes(bytes(b))


def test_index_records_each_shards_sha256(tmp_path):
    _save(tmp_path / "ck", max_shard_bytes=4 << 20)
    index = json.loads((tmp_path / "ck" / INDEX).read_text())
    sums = index["metadata"]["k3_sha256"]
    assert len(sums) > 1 and set(sums) == set(index["weight_map"].values())
    for f, digest in sums.items():
        assert hashlib.sha256((tmp_path / "ck" / f).read_bytes()).hexdigest() == digest


def test_a_flipped_byte_is_refused_naming_the_shard_and_no_verify_loads_it(tmp_path, capsys):
    model = _save(tmp_path / "ck", max_shard_bytes=4 << 20)
    index = json.loads((tmp_path / "ck" / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    victim = shards[1]  # not the first: the message must name the one that changed
    _flip_data_byte(tmp_path / "ck" / victim)
    with pytest.raises(CheckpointError, match=f"shard {victim} .*does not match the SHA-256"):
        from_pretrained(tmp_path / "ck")
    loaded = from_pretrained(tmp_path / "ck", verify=False)  # the bytes are valid safetensors, just different
    differ = [n for (n, a), b in zip(model.state_dict().items(), loaded.state_dict().values()) if not torch.equal(a, b)]
    assert len(differ) == 1

    data = tmp_path / "data"
    data.mkdir()
    for name, text in (("a.txt", "hello world, "), ("b.txt", "goodbye moon, ")):  # one is held out for the eval
        (data / name).write_text(text * 400)  # distinct texts: identical documents are dropped as duplicates
    common = ["eval", "--ckpt", str(tmp_path / "ck"), "--data", str(data), "--seq-len", "32", "--device", "cpu"]
    rc, err = _cli_error(capsys, common)
    assert rc == 2 and len(err) == 1 and victim in err[0] and err[0].startswith("k3 eval: "), err
    assert main(common + ["--no-verify"]) == 0
    assert "held-out loss" in capsys.readouterr().out


def test_checkpoints_without_digests_load_unverified(tmp_path):
    # e.g. the official release, whose index has no k3_sha256
    model = _save(tmp_path / "ck")
    index = json.loads((tmp_path / "ck" / INDEX).read_text())
    del index["metadata"]["k3_sha256"]
    (tmp_path / "ck" / INDEX).write_text(json.dumps(index))
    _flip_data_byte(tmp_path / "ck" / SHARD)
    loaded = from_pretrained(tmp_path / "ck")
    assert sum(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values())) == 1


def test_hashing_streams_in_8_mib_blocks(tmp_path, monkeypatch):
    import k3.checkpoint as ckmod

    path = tmp_path / "big.safetensors"
    path.write_bytes(os.urandom((20 << 20) + 5))  # larger than two blocks
    updates = []
    real = hashlib.sha256

    class Recording:
        def __init__(self, *a):
            self.h = real(*a)

        def update(self, b):
            updates.append(len(b))
            self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(ckmod.hashlib, "sha256", Recording)
    digest = ckmod.sha256_file(str(path))
    monkeypatch.undo()
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert updates == [8 << 20, 8 << 20, (4 << 20) + 5]


def test_shards_are_written_as_they_fill_not_after_the_whole_state_is_gathered(tmp_path, monkeypatch):
    # a shard's tensors (copied to the host one at a time by write_safetensors) are written before the next
    # shard's are produced: the host holds at most one shard's worth of references, never the whole model
    import k3.checkpoint as ck

    model = K3ForCausalLM(_cfg()).init_weights(seed=0)
    order = []
    real_dict, real_write = ck.state_dict_for_disk, ck.write_safetensors

    def producing(*a, **k):
        for name, t in real_dict(*a, **k):
            order.append(("yield", name))
            yield name, t

    def writing(path, tensors, **k):
        order.append(("write", sorted(tensors)))
        return real_write(path, tensors, **k)

    monkeypatch.setattr(ck, "state_dict_for_disk", producing)
    monkeypatch.setattr(ck, "write_safetensors", writing)
    save_pretrained(model, tmp_path / "ck", max_shard_bytes=1 << 20)
    writes = [i for i, e in enumerate(order) if e[0] == "write"]
    yields = [i for i, e in enumerate(order) if e[0] == "yield"]
    assert len(writes) > 2 and writes[0] < yields[-1]  # the first shard is on disk before the last tensor exists
    loaded = from_pretrained(tmp_path / "ck")
    for (n, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), n
