"""Built-in chat prompts written for specdraft, one small set per Spec-Bench subtask (Xia et al. 2024): multi-turn
conversation, translation, summarization, question answering, mathematical reasoning and retrieval-augmented
generation. Used by ``specdraft demo`` and as a quick benchmark suite; :func:`encode_prompt` turns a prompt into
token ids."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.errors import SpecdraftError

_ARTICLE = (
    "The town council of Millbrook voted on Tuesday to convert the old railway depot into a public library. "
    "The depot, built in 1911, has stood empty since the line closed in 1987. Under the plan, the building's brick "
    "walls and iron roof trusses will be kept, while a new glass entrance will face the river. The project will cost "
    "4.2 million dollars, of which 2.5 million comes from a state heritage grant and the rest from the town budget. "
    "Council member Ana Ruiz said the library will have a children's reading room, a local history archive and "
    "twelve public computers. Work is expected to begin in March and finish within eighteen months. Some residents "
    "argued that the money should go to road repairs instead, but the vote passed six to one."
)

_PASSAGE = (
    "Document 1: The Rhine is a river that begins in the Swiss Alps and flows about 1,230 kilometres to the North "
    "Sea. It forms part of the border between Switzerland and Germany and between France and Germany.\n"
    "Document 2: The Danube is Europe's second-longest river, about 2,850 kilometres long. It rises in the Black "
    "Forest of Germany and flows east into the Black Sea, passing through ten countries, more than any other river.\n"
    "Document 3: The Rhine carries heavy barge traffic; Duisburg, on the Rhine, has one of the largest inland ports "
    "in the world."
)


@dataclass(frozen=True)
class Prompt:
    """One built-in question; ``category`` uses Spec-Bench's subtask names."""

    category: str
    text: str


BUILTIN_PROMPTS: tuple[Prompt, ...] = (
    Prompt("mt_bench", "Write a short, friendly email inviting my neighbours to a garden party on Saturday."),
    Prompt("mt_bench", "Give me three tips for staying focused while studying at home."),
    Prompt("translation", "Translate to English: \"Le chat dort sur le canapé pendant que la pluie tombe dehors.\""),
    Prompt("translation", "Translate to English: \"Ich möchte morgen früh mit dem Zug nach Berlin fahren.\""),
    Prompt("summarization", f"Summarize the following article in three sentences.\n\n{_ARTICLE}"),
    Prompt("summarization", f"List the key facts in this article as bullet points.\n\n{_ARTICLE}"),
    Prompt("qa", "What is the difference between weather and climate?"),
    Prompt("qa", "Why do leaves change colour in autumn?"),
    Prompt("math_reasoning", "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Explain."),
    Prompt("math_reasoning", "If a train travels 180 km in 2 hours, what is its average speed? Show your steps."),
    Prompt("rag", f"{_PASSAGE}\n\nUsing only the documents above, which river flows through more countries?"),
    Prompt("rag", f"{_PASSAGE}\n\nUsing only the documents above, where does the Rhine begin and end?"),
)


def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt; with ``chat`` the text is one user turn in the tokenizer's chat template."""
    if not text or not text.strip():
        raise SpecdraftError("empty prompt")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: bytes that were not UTF-8 on the command line
        raise SpecdraftError(f"the prompt is not UTF-8 text (character {exc.start + 1} is a lone surrogate, "
                             f"{text[exc.start]!r})") from None
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SpecdraftError("--chat needs a tokenizer with a chat template; this one has none")
        return encode_prompts(tokenizer, [[{"role": "user", "content": text}]])[0]
    return list(tokenizer(text)["input_ids"])


def encode_prompts(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Each conversation's chat-template tokens with the generation prompt: the templates rendered one by one, the
    texts tokenized in one batched call (a fast tokenizer spreads it over the cores: tokenizing is most of the cost,
    and one by one it holds a GPU's data stage up for seconds a shard). The same ids as ``apply_chat_template``."""
    if not conversations:
        return []
    texts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
             for messages in conversations]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
