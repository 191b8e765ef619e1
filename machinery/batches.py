"""A step's batch as data: the prompts it draws (PromptSampler: endless seeded passes, resumable), the names its
tensors take, the examples' own fields, two sampling rounds joined (GRPO's dynamic sampling), the model inputs of a
sampled batch, PPO's minibatch order and the rollout's passes by micro-batches. Plumbing both loops call around the
algorithm; the rows a micro-batch picks and the batch each entry point receives are common.select_rows and
common.entry_batch."""

import random

import torch

from machinery.errors import UsageError


class PromptSampler:
    """Endless shuffled passes over the training examples, with its own seeded RNG (so resumable)."""

    def __init__(self, examples, seed):
        self.examples, self.rng, self.order = examples, random.Random(seed), []

    def sample(self, n):
        batch = []
        while len(batch) < n:
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            batch.append(self.examples[self.order.pop()])
        return batch

    def state_dict(self):
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state):
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])


ROLLOUT_KEYS = ("prompts", "answers", "completions", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
ROLLOUT_KEYS += ("token_scores", "scores")  # what rollout computes; the rest of its batch is the examples' fields
# The names a step's batch or dump gives its own tensors: an example's field may not take one.
BATCH_NAMES = (*ROLLOUT_KEYS, "rewards", "values", "old_logp", "ref_logp", "advantages", "returns", "eos_ids")
BATCH_NAMES += (
    "kl_coef",
    "num_seqs",
    "num_tokens",
    "new_logp",
    "new_values",
    "entropy",
    "per_token_loss",
    "loss",
    "minibatches",
)


def example_fields(examples, per_prompt):
    """The examples' fields besides prompt and answer (tasks/user.other_fields: a `margin`, a `difficulty`), each
    repeated for the `per_prompt` completions of its prompt: a tensor [N] when every value is a number (int64, or
    float32 with any float among them; a bool: bool), else a list [N] (None where an example lacks the field)."""
    names = sorted({key for example in examples for key in example} - {"prompt", "answer"})
    taken = [name for name in names if name in BATCH_NAMES or name.startswith("micro")]
    if taken:
        raise UsageError(f"the examples' field {taken[0]!r} is a name the batch uses for its own: rename it")
    fields = {}
    for name in names:
        values = [example.get(name) for example in examples for _ in range(per_prompt)]
        numbers = all(isinstance(v, (int, float)) for v in values) and len({type(v) is bool for v in values}) == 1
        fields[name] = torch.as_tensor(values) if numbers and all(abs(v) < 2**63 for v in values) else values
    return fields


def concat_batches(a, b):
    """Two rollout batches as one, rows of `a` then `b`: prompts stay left-padded and completions right-padded
    to the wider of the two (pad id 0, mask 0: every pad position is masked out). Lists are joined, [N] tensors
    concatenated."""
    joined = {}
    for key, x in a.items():
        y = b[key]
        if not torch.is_tensor(x):
            joined[key] = x + y
            continue
        if x.dim() == 2:  # [N, width]: pad the narrower one, on the left for prompts
            width, left = max(x.shape[1], y.shape[1]), key.startswith("prompt")
            pad = lambda t: torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]))
            x, y = pad(x), pad(y)
        joined[key] = torch.cat([x, y])
    return joined


def model_inputs(batch):
    """(input_ids, attention_mask [N, P + T], completion_mask [N, T]) of a sampled batch: what token_logprobs and PPO's
    critic read, prompt (left-padded) then completion. A micro-batch's: `[x[rows] for x in inputs]`."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    return input_ids, torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1), batch["completion_mask"]


def batch_inputs(batch, setup=None):
    """What the algorithm reads of a sampled batch beside its rewards: the token ids and masks a model reads
    (prompt_ids, prompt_mask [N, P], completion_ids, completion_mask [N, T]), the examples' other fields [N]
    (a `margin`: example_fields) and the run's setup state (the algorithm file's setup_state, the same every step),
    each under its own name, so they reach the entry points' batches and the dumps."""
    names = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    taken = [name for name in setup or {} if name in BATCH_NAMES or name in batch or not isinstance(name, str)]
    if taken:
        raise UsageError(f"setup_state's {taken[0]!r} is a name the batch uses for its own: rename it")
    return dict(setup or {}, **{key: value for key, value in batch.items() if key in names or key not in ROLLOUT_KEYS})


def shuffled_minibatches(n, epochs, num_minibatches, device):
    """PPO's minibatches: `epochs` passes over rows 0..n-1, each in a fresh random order (torch's generator, drawn as
    each pass begins) cut into `num_minibatches` index tensors."""
    for _ in range(epochs):
        yield from torch.randperm(n, device=device).split(n // num_minibatches)


def in_micro_batches(fn, model, inputs, size, *extra):
    """fn(model, *a micro-batch's inputs, *extra) over consecutive micro-batches of `size` rows, concatenated: a
    rollout's passes without gradient (old and reference log-probs, PPO's values), at a micro-batch's memory."""
    starts = range(0, len(inputs[0]), size)
    return torch.cat([fn(model, *(x[i : i + size] for x in inputs), *extra) for i in starts])
