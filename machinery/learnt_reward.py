"""--reward-model: a learnt reward instead of the task's. A sequence-classification model with one output reads each
prompt + completion, as reward_model.py trains it (reward_texts, reward_inputs: the same text and tokens)."""

import torch

from machinery import model_checks
from machinery.errors import UsageError
from machinery.models import load_pretrained, load_tokenizer, longest, unwritable_characters


class RewardModel:
    """--reward-model: a sequence-classification model with one output scores each prompt + completion.

    The canonical RLHF setup (Ouyang et al. 2022). The text is re-tokenised with the reward model's own
    tokenizer (through its chat template when it has one), so it need not share the policy's tokenizer.
    """

    def __init__(self, name, device, dtype, batch_size=16):
        from transformers import AutoModelForSequenceClassification

        self.name, self.batch_size = f"reward model {name}", batch_size
        self.tokenizer = load_tokenizer(name)
        self.tokenizer.padding_side = "right"
        from transformers.utils import logging

        missing, verbosity = [], logging.get_verbosity()
        logging.set_verbosity_error()  # transformers' load report: a missing head is refused below, in one line
        self.model = load_pretrained(AutoModelForSequenceClassification, name, device, dtype, missing).eval()
        logging.set_verbosity(verbosity)
        model_checks.check_reward_model_config(self.model.config, name, "--reward-model")  # as saved: 1 output
        model_checks.check_trained_head(missing, name, "--reward-model")
        model_checks.check_token_ids(self.model, self.tokenizer, [], f"--reward-model {name}")
        if self.model.config.pad_token_id is None:  # it finds each row's last token through the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def check_task(self, task, max_new_tokens):
        """Refuse a reward model that cannot read the task's text: characters of its prompts or answers its
        tokenizer does not know (it would score <unk>s), or fewer positions than the longest prompt, as it reads
        it, and --max-new-tokens (a completion would run past its position embeddings)."""
        name = self.name.removeprefix("reward model ")
        texts = [example[key] for example in task.train + task.test for key in ("prompt", "answer")]
        unknown = unwritable_characters(self.tokenizer, texts)
        if unknown:
            char = next(c for t in texts for c in t if c in unknown)
            raise UsageError(
                f"the tokenizer of --reward-model {name!r} does not know {len(unknown)} of the characters of task "
                f"{task.name!r} (e.g. {char!r}), so it would score <unk>s: pass a reward model trained on text "
                "like the task's (from a model of the policy's family)"
            )
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if not limit:
            return
        prompts = [example["prompt"] for example in task.train + task.test]
        texts, templated = reward_texts(self.tokenizer, prompts, [""] * len(prompts))
        (length, _), over = longest(self.tokenizer, texts, limit - max_new_tokens, None if templated else False)
        if over:
            raise UsageError(
                f"--reward-model {name!r} has {limit} positions, fewer than the longest prompt of task {task.name!r} "
                f"as it reads it ({length} tokens) and --max-new-tokens {max_new_tokens}: pass a reward model with "
                "more positions, or shorten the prompts"
            )

    def score(self, prompts, completions, answers):
        scores = []
        with torch.no_grad():
            for i in range(0, len(prompts), self.batch_size):
                rows = slice(i, i + self.batch_size)
                enc = reward_inputs(self.tokenizer, prompts[rows], completions[rows]).to(self.model.device)
                scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores


def reward_texts(tokenizer, prompts, completions):
    """The texts a reward model reads, and whether its chat template rendered them: each prompt and completion as
    a user and an assistant turn when the tokenizer has a template, else the two strings joined. A prompt and a
    completion given as lists of messages (conversational preference data) are one conversation, rendered as they
    are. reward_model.py trains on exactly what RewardModel scores here."""
    conversational = [isinstance(p, list) for p in prompts]
    if not tokenizer.chat_template:
        if any(conversational):
            raise UsageError("conversational pairs (lists of messages) need a tokenizer with a chat template")
        return [p + c for p, c in zip(prompts, completions)], False
    chats = [
        p + c if isinstance(p, list) else [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        for p, c in zip(prompts, completions)
    ]
    return tokenizer.apply_chat_template(chats, tokenize=False), True


def reward_inputs(tokenizer, prompts, completions):
    """reward_texts tokenised, right-padded: a *ForSequenceClassification model reads each row's score at its last
    token that is not the pad id. A rendered template already holds its BOS: adding special tokens again would give
    two, so they are added to plain texts only."""
    texts, templated = reward_texts(tokenizer, prompts, completions)
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=not templated)
