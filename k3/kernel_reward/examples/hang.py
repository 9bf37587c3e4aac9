"""A candidate that never returns."""


def kernel(x, weight, eps):
    while True:
        pass
