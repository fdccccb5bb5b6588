"""Tests that launch ranks (torchrun, ``torch.multiprocessing.spawn``) or kill real processes with
signals; each module is marked ``slow`` (``-m "not slow"`` leaves them out of a quick local run)."""
