"""One GRPO update of a causal LM from scored rollouts, made as RL frameworks make it.

Shapes: N response tokens of a micro-batch, V vocabulary.

Each prompt's G rollouts form a group; a rollout's advantage is its reward minus the group's mean,
over the group's standard deviation (a group whose rewards are all equal has none and is skipped).
The old log-probabilities are recomputed by the trainer's own forward before the update, not
taken from the rollout engine: the engine samples in its own numerics (bf16, other kernels), and
the ratio must compare the trainer with itself. The loss is PPO's clipped surrogate per response
token, -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), averaged over every response token of
the update; one AdamW step follows (gradient norm clipped). After the step the same rollouts are
scored again, giving KL(new || old) per response token: the full distributions at each position,
sum_v p_new log(p_new / p_old), averaged, which says how far the policy moved.

The trainer holds its own float32 copy of the model (transformers' module, unfused); `weights`
hands its parameters, cast, to a rollout engine's `update_weights`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GrpoConfig:
    lr: float = 1e-6
    clip: float = 0.2  # eps of the clipped ratio
    max_grad_norm: float = 1.0
    micro_batch: int = 8  # rollouts per forward


@dataclass
class Rollout:
    prompt: list[int]
    tokens: list[int]  # the response
    reward: float


def advantages(rewards: list[float]) -> list[float]:
    """A group's advantages: (r - mean) / std; all zero when the rewards are all equal."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [0.0 if std < 1e-8 else (r - mean) / std for r in rewards]


class GrpoTrainer:
    def __init__(self, model: torch.nn.Module, config: GrpoConfig = GrpoConfig()):
        self.model, self.config = model, config
        for p in model.parameters():
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)

    def step(self, groups: list[list[Rollout]]) -> dict:
        """One update from the groups' rollouts. Returns the loss, KL(new || old) per response
        token, the gradient norm, the rollouts that carried an advantage and the seconds taken."""
        start = time.perf_counter()
        weighted = [(r, a) for group in groups for r, a in zip(group, advantages([r.reward for r in group])) if r.tokens]
        batches = [weighted[i : i + self.config.micro_batch] for i in range(0, len(weighted), self.config.micro_batch)]
        self.model.eval()  # no dropout: the ratio must compare like with like
        with torch.no_grad():
            old = [self._log_softmax([r for r, _ in batch]) for batch in batches]  # (N, V) per micro-batch
        tokens = sum(len(r.tokens) for r, _ in weighted)
        trained = [(batch, o) for batch, o in zip(batches, old) if any(a != 0.0 for _, a in batch)]
        loss_sum = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for batch, old_logp in trained:
            new_logp = self._log_softmax([r for r, _ in batch])
            chosen = torch.tensor([t for r, _ in batch for t in r.tokens]).view(-1, 1)
            advantage = torch.tensor([a for r, a in batch for _ in r.tokens])
            ratio = (new_logp.gather(1, chosen) - old_logp.gather(1, chosen)).squeeze(1).exp()
            surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - self.config.clip, 1 + self.config.clip) * advantage)
            loss = -surrogate.sum() / tokens  # the mean over every response token of the update
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)) if trained else 0.0
        if trained:
            self.optimizer.step()
        with torch.no_grad():
            kl = sum(float((new.exp() * (new - o)).sum()) for new, o in ((self._log_softmax([r for r, _ in b]), o) for b, o in zip(batches, old)))
        return {"loss": loss_sum, "kl_per_token": kl / max(1, tokens), "grad_norm": grad_norm,
                "trained_rollouts": sum(a != 0.0 for _, a in weighted), "seconds": time.perf_counter() - start}

    def _log_softmax(self, rollouts: list[Rollout]) -> torch.Tensor:
        """(N, V) float32 log-probabilities at each response token's position, in order."""
        sequences = [r.prompt + r.tokens for r in rollouts]
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, s in enumerate(sequences):  # right padding: positions stay 0..len-1
            ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits  # (B, T, V): the family's own head (soft-capping included)
        # the row before each response token predicts it
        rows = torch.cat([logits[row, len(r.prompt) - 1 : len(r.prompt) + len(r.tokens) - 1] for row, r in enumerate(rollouts)])
        return rows.float().log_softmax(-1)

    def weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every parameter by name (tied ones under each name), cast for a rollout engine."""
        return {name: p.detach().to(dtype) for name, p in self.model.named_parameters(remove_duplicate=False)}
