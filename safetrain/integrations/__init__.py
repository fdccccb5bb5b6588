"""Integrations with training frameworks, each an optional extra imported only on demand.

``safetrain.integrations.lightning`` (``pip install safetrain[lightning]``): ``SafeTrainingCallback``, a
PyTorch Lightning callback; ``safetrain.integrations.huggingface`` (``pip install
safetrain[huggingface]``): ``SafeTrainingCallback`` for ``transformers.Trainer``. Import the one you
use; nothing is imported here, so ``import safetrain`` never imports a framework.
"""
