"""What the Hugging Face tests build: a tiny GPT-2 from a config (random weights, no download),
padded random token rows, the ``TrainingArguments`` and a ``Trainer`` run with ``SafeTrainingCallback``
(``train``) and a callback that records whether each step moved the parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from safetrain.integrations.huggingface import SafeTrainingCallback

QUIET = {"detect": {"check_weights_every": 0}, "log": {"level": "WARNING"}}


class Tokens(torch.utils.data.Dataset):
    """Random token rows of random lengths, right-padded: ``input_ids``, ``attention_mask``, ``labels``
    (-100 on the padding for a language model; one class per row for a classifier)."""

    def __init__(self, n: int = 64, length: int = 12, classify: bool = False, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 100, (n, length), generator=g)
        self.lens = torch.randint(3, length + 1, (n,), generator=g)
        self.classes = torch.randint(0, 2, (n,), generator=g)
        self.classify = classify

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        n = int(self.lens[i])
        ids, mask = self.ids[i].clone(), torch.zeros_like(self.ids[i])
        mask[:n], ids[n:] = 1, 0
        labels = self.classes[i] if self.classify else torch.where(mask.bool(), ids, torch.tensor(-100))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg)


def args(out: Path, steps: int, **kw: Any) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=steps,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        logging_steps=5,
        learning_rate=1e-3,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return TrainingArguments(**{**base, **kw})


class Moves(TrainerCallback):
    """Whether each optimizer step changed the parameters (by the Trainer's global_step)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.moved, self.before = model, {}, None

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).clone()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.before = self.flat()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.moved[state.global_step] = not torch.equal(self.flat(), self.before)


def train(
    model: torch.nn.Module,
    out: Path,
    steps: int,
    cfg: Optional[dict] = None,
    data: Any = None,
    extra: List[Any] = (),
    resume: Optional[str] = None,
    on_abort: str = "raise",
    **kw: Any,
):
    cb = SafeTrainingCallback({**QUIET, **(cfg or {})}, on_abort=on_abort)
    moves = Moves(model)
    trainer = Trainer(
        model=model, args=args(out, steps, **kw), train_dataset=data or Tokens(), callbacks=[cb, moves, *extra]
    )
    trainer.train(resume_from_checkpoint=resume)
    return cb, moves, trainer
