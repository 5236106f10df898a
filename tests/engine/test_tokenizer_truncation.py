"""`Tokenizer.encode_truncated` (vLLM's `truncate_prompt_tokens` and `truncation_side`) against transformers'
own left truncation (`truncation=True, max_length=k`, `truncation_side="left"`), on the
embedded SmolLM2 tokenizer (which adds no special tokens) and on the same vocabulary with
a BOS-adding post-processor, where the BOS must stay and count in k."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from engine.tokenizer import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog, then naps. " * 3


@pytest.fixture(scope="module", params=["no-specials", "bos"])
def tokenizers_pair(
    request: pytest.FixtureRequest, model_smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    directory = tmp_path_factory.mktemp(request.param)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(Path(model_smollm2_dir) / name, directory / name)
    if request.param == "bos":
        raw = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        bos = "<|im_start|>"
        raw.post_processor = TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))]
        )
        raw.save(str(directory / "tokenizer.json"))
    reference = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), truncation_side="left"
    )
    return Tokenizer(directory), reference


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("k", [1, 2, 7, 30, 10_000])
def test_keeps_what_transformers_keeps(
    tokenizers_pair: tuple[Tokenizer, PreTrainedTokenizerFast],
    k: int,
    add_special_tokens: bool,
    side: str,
) -> None:
    ours, reference = tokenizers_pair
    full = ours.encode(TEXT, add_special_tokens)
    reference.truncation_side = side
    expected = reference(
        TEXT, truncation=True, max_length=k, add_special_tokens=add_special_tokens
    )["input_ids"]
    for release_gil in (False, True):
        ids, cut = ours.encode_truncated(TEXT, k, side, add_special_tokens, release_gil)
        assert ids == expected
        assert cut == (len(full) > k)
    if k >= len(full):
        assert ids == full
    elif k > 2:
        plain = ours.encode(TEXT, False)
        kept = [t for t in ids if t in plain]
        assert kept == (plain[-len(kept) :] if side == "left" else plain[: len(kept)])


def test_the_bos_stays_and_counts(
    request: pytest.FixtureRequest, tokenizers_pair: tuple[Tokenizer, PreTrainedTokenizerFast]
) -> None:
    ours, _ = tokenizers_pair
    full = ours.encode(TEXT, True)
    plain = ours.encode(TEXT, False)
    ids, cut = ours.encode_truncated(TEXT, 5, "left", True)
    assert cut and len(ids) == 5
    if "bos" in request.node.callspec.id:
        assert full == [ours.token_to_id("<|im_start|>"), *plain]
        assert ids == [full[0], *plain[-4:]]
    else:
        assert full == plain
        assert ids == plain[-5:]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(("head", "k"), [(1, 10_000), (6, 10_000), (6, 4), (6, 2), (10_000, 5)])
def test_head_keeps_the_first_tokens_before_truncating(
    tokenizers_pair: tuple[Tokenizer, PreTrainedTokenizerFast], head: int, k: int, side: str
) -> None:
    """The score APIs' max_tokens_per_query / _doc: the text's first `head` tokens, its
    special tokens added after and not counted; truncate_prompt_tokens then cuts those
    to k on its side, as transformers would cut the headed text's ids."""
    ours, reference = tokenizers_pair
    plain = reference(TEXT, add_special_tokens=False)["input_ids"]
    full = reference(TEXT)["input_ids"]
    specials = len(full) - len(plain)  # a prefix here: none, or the BOS
    kept = plain[:head]
    room = k - specials
    kept = kept[-room:] if side == "left" else kept[:room]
    expected = full[:specials] + kept
    ids, cut = ours.encode_truncated(TEXT, k, side, True, head=head)
    assert ids == expected
    assert cut == (len(plain) > len(kept))
    assert ours.encode_truncated(TEXT, k, side, True, True, head=head) == (ids, cut)


@pytest.mark.parametrize("n", [0, 1, 3, 8, 20, 10_000])
def test_leading_text_is_a_prefix_of_at_most_n_tokens(
    tokenizers_pair: tuple[Tokenizer, PreTrainedTokenizerFast], n: int
) -> None:
    """vLLM's truncate_text_to_tokens (a cross-encoder's query and document are cut as
    text): a prefix of the text, at most n tokens (special tokens not counted), cut at a
    token boundary, so its tokens are the text's first ones."""
    ours, _ = tokenizers_pair
    text = TEXT + " 你好\uff0c世界 🌍"
    kept = ours.leading_text(text, n)
    assert ours.leading_text(text, n, release_gil=True) == kept
    assert text.startswith(kept)
    ids = ours.encode(kept, add_special_tokens=False)
    full = ours.encode(text, add_special_tokens=False)
    assert len(ids) == min(n, len(full))
    assert ids == full[: len(ids)]
