"""What the tests share, one module per kind of thing; no test module imports another.

``models``: the tiny regression model, its data and loader; ``processes``: running a script, a
2-rank launch, torchrun; ``ranks``: what the DDP and FSDP2 rank scripts build alike; ``fsdp``:
the FSDP2 launches; ``bounds``: what a fuzz example may cost. The others hold the scenarios that
more than one test file runs (``engine``, ``causes``, ``healthy``, ``outcome``, ...).
"""
