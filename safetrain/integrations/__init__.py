"""Integrations with training frameworks, each an optional extra imported only on demand.

``safetrain.integrations.huggingface`` (``pip install safetrain[huggingface]``) and
``safetrain.integrations.lightning`` (``pip install safetrain[lightning]``): import the one you
use; ``import safetrain`` imports neither framework.
"""
