"""A Hugging Face ``Trainer`` run that survives a layer going NaN: ``SafeTrainingCallback``.

A tiny GPT-2 built from a config (random weights, no download) trains on synthetic padded token
rows. At step 8 one transformer block's MLP emits NaN (``safetrain.testing.OutputFault``, also
during the guard's replay, so the fault is reproducible). The guard finds it at that step and
layer, skips the step (the Trainer's ``optimizer.step()`` changes nothing: its gradients were
dropped; its LR scheduler does not advance), and training goes on to the end with finite weights.
The journal lands in the Trainer's ``output_dir``.

Run: ``python examples/hf_trainer_callback.py [output_dir]`` (needs ``pip install safetrain[huggingface]``).
"""

from __future__ import annotations

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from safetrain.integrations.huggingface import SafeTrainingCallback
from safetrain.testing import OutputFault


class Tokens(torch.utils.data.Dataset):
    """Random token rows of random lengths, right-padded; labels -100 on the padding."""

    def __init__(self, n: int = 128, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 100, (n, length), generator=g)
        self.lens = torch.randint(4, length + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lens[i])
        ids, mask = self.ids[i].clone(), torch.zeros_like(self.ids[i])
        mask[:n], ids[n:] = 1, 0
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def main(output_dir: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                                       bos_token_id=1, eos_token_id=2))  # fmt: skip
    # Step 8's forward, and the guard's replay of it, emit NaN in block 1's MLP.
    OutputFault(model.transformer.h[1].mlp, calls=[8, 9, 10])

    callback = SafeTrainingCallback({"snapshot": {"every": 5}, "log": {"level": "WARNING"}})
    args = TrainingArguments(
        output_dir=output_dir, max_steps=20, per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=10,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.train()  # raises TrainingAborted, naming cause and fix, if the guard had to stop training

    result = callback.result
    for event in result.events:
        if event.name == "anomaly":
            print(f"step {event.step}: {event.kind} -> {event.action}")
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(
        f"{result.steps} steps, {result.skipped_batches} skipped, scheduler at step {trainer.lr_scheduler.last_epoch}, "
        f"finite weights: {finite}; journal: {output_dir}/events.jsonl"
    )
    if finite and result.skipped_batches == 1 and result.ended == "done":
        print("recovered: the NaN step was skipped and training finished")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="safetrain-hf-"))
