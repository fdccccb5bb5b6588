"""Hugging Face-style training: dict batches, and a model that returns an output with ``.loss``.

SafeTrainer calls ``model(**batch)`` for a dict batch and takes ``output.loss``; keys named
``labels`` are targets for the sanitizer, the rest inputs. The dataset holds one empty sequence
(all padding): attention pooling with ``masked_fill(-inf)`` + softmax gives NaN for it, the
classic fully-masked-row bug. safetrain names the layer and skips that batch; the second run
uses ``safetrain.masked_softmax`` and has nothing to skip.

Run: python examples/huggingface_style.py
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from safetrain import SafeTrainer, load_config, masked_softmax

VOCAB, LENGTH, PAD = 50, 12, 0
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class ClassifierOutput:
    """What a ``transformers`` sequence classifier returns (``SequenceClassifierOutput``), in small."""

    loss: Optional[torch.Tensor]
    logits: torch.Tensor


class TinyClassifier(torch.nn.Module):
    """Embeddings, attention pooling over the non-padding tokens, and a linear head."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.embed = torch.nn.Embedding(VOCAB, 32, padding_idx=PAD)
        self.score = torch.nn.Linear(32, 1)
        self.head = torch.nn.Linear(32, 2)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: Optional[torch.Tensor] = None
    ) -> ClassifierOutput:
        h = self.embed(input_ids)  # (batch, length, 32)
        scores = self.score(h).squeeze(-1)  # (batch, length)
        keep = attention_mask.bool()
        if self.safe:
            weights = masked_softmax(scores, keep)  # an all-padding row gives zeros
        else:
            weights = scores.masked_fill(~keep, float("-inf")).softmax(-1)  # ... or NaN here
        logits = self.head((weights.unsqueeze(-1) * h).sum(1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ClassifierOutput(loss=loss, logits=logits)


class Sequences(Dataset):
    """Token sequences labelled by whether low-id tokens outnumber high-id ones; sample 5 is empty."""

    def __init__(self, n: int = 1024, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(4, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH) < lengths[:, None]).long()
        self.mask[5] = 0  # an empty text: nothing but padding
        self.ids = self.ids * self.mask
        low = ((self.ids > 0) & (self.ids < VOCAB // 2)).sum(1)
        self.labels = (low * 2 > self.mask.sum(1)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def train(safe: bool) -> None:
    torch.manual_seed(0)
    loader = DataLoader(Sequences(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = TinyClassifier(safe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = load_config(CONFIGS / "default.yaml", ["log.progress=false", "snapshot.every=25"])
    result = SafeTrainer(model, optimizer, cfg).fit(loader, epochs=4)  # no loss_fn: the model returns .loss

    data = Sequences()
    with torch.no_grad():
        out = model(input_ids=data.ids, attention_mask=data.mask)
    accuracy = (out.logits.argmax(1) == data.labels).float().mean().item()
    print(
        f"{'masked_softmax' if safe else 'masked_fill(-inf)+softmax'}: {result.steps} steps, "
        f"{result.skipped_batches} skipped, final loss {result.final_loss:.3f}, accuracy {accuracy:.1%}"
    )
    for event in result.events:
        if event.name == "anomaly":
            print(f"  step {event.step}: {event.message}")


def main() -> None:
    train(safe=False)
    train(safe=True)


if __name__ == "__main__":
    main()
