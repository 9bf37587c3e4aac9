"""A candidate that takes its process down (as a segfaulting extension would)."""

import os


def kernel(x, weight, eps):
    os.abort()
