"""Toy models and drafters for tests: tiny random Llamas, a bigram table LM, and drafters that are right on a
chosen pattern of positions."""

from __future__ import annotations

import itertools
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.drafters.base import Draft
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.models.hf import HFCausalLM


def tiny_llama(seed: int = 0, vocab_size: int = 64, layers: int = 2, hidden: int = 32, std: float = 0.3,
               max_positions: int = 256) -> LlamaForCausalLM:
    """A random Llama whose logits are peaked enough for greedy decoding to be stable (fp32)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, initializer_range=std, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


class TableCache:
    """Cache of the bigram LM: only a length (the model keeps no keys or values)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length

    def compact(self, start: int, slots) -> None:
        assert 0 <= start <= self.length and all(start <= s < self.length for s in slots)
        self.length = start + len(slots)


class BigramLM:
    """A CausalLM whose logits depend only on the current token: logits[t] = table[input[t]]."""

    def __init__(self, table: torch.Tensor, name: str = "bigram") -> None:
        self.table = table  # (V, V)
        self.vocab_size = table.shape[0]
        self.max_context = 1 << 20
        self.dtype = torch.float32
        self.name = name

    def new_cache(self, capacity: int, batch_size: int = 1) -> TableCache:
        return TableCache(capacity)

    def forward(self, input_ids: torch.Tensor, cache: TableCache, positions=None, attention_mask=None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """Positions and masks do not matter to a bigram: each row depends on its own token only."""
        cache.length += input_ids.shape[1]
        assert cache.length <= cache.capacity
        return self.table[input_ids[:, -logits_to_keep:] if logits_to_keep else input_ids]  # (B, T or k, V)


def random_bigram(vocab_size: int, seed: int, scale: float = 1.5) -> BigramLM:
    generator = torch.Generator().manual_seed(seed)
    return BigramLM(torch.randn(vocab_size, vocab_size, generator=generator) * scale, name=f"bigram{seed}")


class PatternDrafter:
    """Greedy oracle drafts (the target's own argmax continuation) corrupted where ``wrong(step, i)`` says so:
    always right, never right, or right on a chosen pattern of positions."""

    name = "pattern"
    max_context = None

    def __init__(self, target, wrong) -> None:
        self.oracle = DraftModelDrafter(target)
        self.vocab_size = target.vocab_size
        self.wrong = wrong
        self.step = 0

    def begin(self, target, cache) -> None:
        pass

    def propose(self, context, num_draft_tokens, sampling, generator) -> Draft:
        tokens = self.oracle.propose(context, num_draft_tokens, sampling, generator).tokens.clone()
        for i in range(tokens.shape[0]):
            if self.wrong(self.step, i):
                tokens[i] = (tokens[i] + 1) % self.vocab_size
        self.step += 1
        return Draft(tokens)

    def observe(self, result) -> None:
        pass


def hf_target(seed: int = 0, **kwargs) -> HFCausalLM:
    return HFCausalLM(tiny_llama(seed, **kwargs), name=f"tiny{seed}")


WORDS = [f"w{i}" for i in range(61)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def tiny_tokenizer(words: list[str] = WORDS, eos: str = "</s>"):
    """A word-level tokenizer: <unk>=0, <s>=1, </s>=2, then ``words``; with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token=eos, unk_token="<unk>",
                                        pad_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_checkpoint(path, seed: int = 0, tokenizer=None, **kwargs):
    """A tiny Llama checkpoint folder (safetensors + tokenizer), as a user's model folder would be."""
    model = tiny_llama(seed, **kwargs)
    model.save_pretrained(path)
    (tokenizer or tiny_tokenizer()).save_pretrained(path)
    return path


def distill_records(count: int, seed: int = 0) -> list[dict]:
    """distill-data records of varied prompt and response lengths (so that batches are padded), token ids in
    3 .. 60 of a tiny Llama's 64."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 61) for _ in range(rng.randint(1, 6))],
             "response_token_ids": [rng.randrange(3, 61) for _ in range(rng.randint(3, 12))]} for _ in range(count)]


def write_data_folder(folder, records: list[dict]):
    """A distill-data folder holding ``records`` in one shard, with the manifest its readers check (counts and
    checksums); returns the folder."""
    import json
    from pathlib import Path

    from specdraft.training.runs.folders import MANIFEST_FILE, shard_entries

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    counts, sums = shard_entries(folder, ["shard-00000.jsonl"])
    manifest = {"complete": True, "num_shards": 1, "shards": counts, "sha256": sums, "records": len(records)}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    return folder


def bigram_sequence_probs(target: BigramLM, prompt, length: int, sampling) -> dict[tuple[int, ...], float]:
    """The exact probability of every ``length``-token continuation of ``prompt`` under a bigram target's warped
    distribution (the reference of the distribution tests)."""
    from specdraft.sampling import warp

    probs = {}
    for seq in itertools.product(range(target.vocab_size), repeat=length):
        prob, last = 1.0, prompt[-1]
        for token in seq:
            prob *= float(warp(target.table[last], sampling)[token])
            last = token
        probs[seq] = prob
    return probs


def assert_sequences_follow(counts, exact: dict[tuple[int, ...], float], trials: int) -> None:
    """Sampled sequences never take a probability-0 continuation, and their counts pass a chi-square against
    ``exact`` (:func:`bigram_sequence_probs`): cells with an expected count >= 5, plus one bucket for the rest."""
    from scipy.stats import chisquare

    assert sum(counts[s] for s, p in exact.items() if p == 0) == 0  # never a token the warping removed
    cells = [seq for seq, p in exact.items() if p * trials >= 5]
    observed = [counts[seq] for seq in cells] + [trials - sum(counts[seq] for seq in cells)]
    expected = [exact[seq] * trials for seq in cells]
    expected.append(trials - sum(expected))
    assert chisquare(observed, expected).pvalue > 1e-3


def assert_follows(counts, p: torch.Tensor, trials: int) -> None:
    """Chi-square of sampled token counts against p (V,): cells with an expected count >= 5, plus one bucket for
    the rest when it is large enough (else the rest must stay rare)."""
    from scipy.stats import chisquare

    support = (p * trials >= 5).nonzero().flatten().tolist()
    observed, expected = [counts[t] for t in support], [float(p[t]) * trials for t in support]
    observed.append(trials - sum(observed))
    expected.append(trials - sum(expected))
    if expected[-1] < 5:  # too little mass outside the support for a bucket: it must stay rare
        assert observed[-1] <= 5 + 4 * expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    expected = [e * sum(observed) / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 1e-3


def second_token_marginal(model, prompt: list[int], sampling) -> torch.Tensor:
    """The exact marginal (V,) of the second generated token, sum_t1 p(t1) p(t2 | t1), of a transformers toy."""
    from specdraft.sampling import warp

    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1], sampling)  # (V,)
        p2 = warp(model(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1], sampling)  # (V, V)
    return p1 @ p2


def sample_second_tokens(target, prompt: list[int], drafter, sampling, trials: int, gamma: int = 3):
    """(Counter of the second generated token, draft tokens accepted at the step that drafts it) over ``trials``
    seeded generations of 3 tokens; for self-drafting heads, whose first draft is at the second token."""
    from collections import Counter

    from specdraft.decoding import generate
    from specdraft.sequence import GenerationConfig

    counts, accepted = Counter(), 0
    for seed in range(trials):
        generator = torch.Generator().manual_seed(seed)
        result = generate(target, prompt, drafter, GenerationConfig(3, gamma, sampling, speculation="fixed"), generator)
        counts[result.token_ids[1]] += 1
        accepted += sum(result.stats.accept_lengths[1:2])
    return counts, accepted


def write_target_gguf(path, tokens, eos=2):
    """A GGUF holding only the tokenizer metadata of a target (all the export reads from it)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos)
    writer.add_chat_template("{{ messages }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
