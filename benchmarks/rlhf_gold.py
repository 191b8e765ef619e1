"""The gold reward of benchmarks/rlhf_real.py: what its synthetic labeller prefers, and the held-out score its runs
watch (`--task python:benchmarks/rlhf_gold.py:gold@prompts.jsonl`: with --reward-model the policy never sees it).

The prompts ask for one short sentence about a topic. The gold pays a sentence of 8 to 16 words that ends (. ! or ?)
and names its topic; anything shorter or longer earns less, linearly, down to 0 at 2 and at 32 words. The model's
own samples are mostly longer than 16 words, so a reward model learnt from pairs of them mostly learns "shorter is
better": true only down to 8 words, the point past which a policy pushed by that reward model loses gold.
"""

import re

PROMPT_TOPIC = re.compile(r"about (?:an? |the )?(?:\w+ )*?(\w+)[.,]")  # "about a red bicycle." -> "bicycle"
LOW, HIGH = (2, 8), (16, 32)  # words: the gold's length term rises from 0 at 2 to 1 at 8, falls from 16 to 0 at 32


def length_term(words):
    """1 for 8 to 16 words, linear down to 0 at 2 and at 32 words."""
    if words < LOW[1]:
        return max(0.0, (words - LOW[0]) / (LOW[1] - LOW[0]))
    return max(0.0, min(1.0, (HIGH[1] - words) / (HIGH[1] - HIGH[0])))


def gold(prompt, completion, answer):
    """0.6 x length_term + 0.2 if it ends in . ! or ? (a finished sentence) + 0.2 if it names the prompt's topic
    (its noun, or that noun with an s); in [0, 1]."""
    words = re.findall(r"[A-Za-z0-9']+", completion)
    match = PROMPT_TOPIC.search(prompt)
    topic = match.group(1).lower() if match else ""
    named = topic and any(w.lower() in (topic, topic + "s") for w in words)
    finished = completion.rstrip().rstrip("\"'").endswith((".", "!", "?"))
    return 0.6 * length_term(len(words)) + 0.2 * finished + 0.2 * bool(named)
