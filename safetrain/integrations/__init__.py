"""Integrations with training frameworks, each an optional extra imported on its own.

``safetrain.integrations.lightning`` (``pip install safetrain[lightning]``): ``SafeTraining``, a
PyTorch Lightning callback. Nothing is imported here: ``import safetrain`` never imports a framework.
"""
