"""specdraft: lossless speculative decoding for chat LLMs, and draft models aligned to them.

Glossary: p = target distribution, q = draft distribution; accepted / recovered / bonus tokens; num_draft_tokens
(γ); block efficiency (τ, tokens per target forward).
"""

from specdraft.api import encode_prompt, eos_token_ids, load_drafter, load_target
from specdraft.compat import check_compatible
from specdraft.decoding import generate
from specdraft.drafters import Draft, Drafter, DraftModelDrafter, NoDrafter, PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.models import load_model, load_tokenizer
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig, GenerationResult
from specdraft.stats import GenerationStats
from specdraft.verification import VerifyResult

__version__ = "0.1.0"

__all__ = [
    "Draft", "DraftModelDrafter", "Drafter", "GenerationConfig", "GenerationResult", "GenerationStats", "NoDrafter",
    "PromptLookupDrafter", "SamplingConfig", "SpecdraftError", "VerifyResult", "check_compatible", "encode_prompt",
    "eos_token_ids", "generate", "load_drafter", "load_model", "load_target", "load_tokenizer",
]
