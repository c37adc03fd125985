"""The decoder registry (issue 66): every decoder registered once by name, with its kind, options,
draft and exactness; the commands look decoders up there."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import recspec.decoding.registry as registry
import recspec.decoding.text  # noqa: F401 (registers the text decoders)
import recspec.knowledge.job  # noqa: F401 (registers the knowledge decoders)
import recspec.recommend  # noqa: F401 (registers the item decoders)
from recspec.decoding.registry import ITEMS, KNOWLEDGE, TEXT, check_owned, decoder, names, register
from recspec.errors import RecspecError


def test_every_decoder_is_registered_once_by_kind() -> None:
    assert names(ITEMS) == ("hf", "beam", "tree-beam", "beam-sample", "spec-strict", "spec-relaxed",
                            "spec-beam-sample", "dsbd", "auto")
    assert names(ITEMS, drafted=True) == ("spec-strict", "spec-relaxed", "spec-beam-sample", "dsbd")
    assert names(ITEMS, exact=True) == ("hf", "beam", "tree-beam", "spec-strict", "auto")
    assert names(TEXT) == ("sample", "spec-sample", "topk-imp", "beam-sample", "dsbd")
    assert names(TEXT, drafted=True) == ("spec-sample", "topk-imp", "dsbd")
    assert names(KNOWLEDGE) == ("ar", "hf", "prompt-lookup", "resd", "laser")
    assert names(KNOWLEDGE, drafted=True) == ("resd", "laser")
    with pytest.raises(RecspecError, match=r"^unknown decoder 'nope'; choose one of sample, spec-sample, "):
        decoder("nope", TEXT)
    with pytest.raises(ValueError, match="registered twice"):
        register("tree-beam", ITEMS, lambda: None, recspec.recommend.DecodeOptions)


def test_a_new_decoder_is_one_registration() -> None:
    @dataclass(frozen=True)
    class EchoOptions:
        loud: bool = False
        OWNED = {"loud": "--loud"}

        def check(self, spec: registry.Decoder) -> None:
            check_owned(self, spec)

    spec = register("echo", TEXT, lambda text: text, EchoOptions, takes=("loud",))
    try:
        assert decoder("echo", TEXT) is spec and "echo" in names(TEXT) and spec.run("hi") == "hi"
        spec.check(EchoOptions(loud=True), has_draft=False)
        with pytest.raises(RecspecError, match="^--loud is an option of echo, not of sample$"):
            EchoOptions(loud=True).check(decoder("sample", TEXT))
    finally:
        del registry._REGISTRY[TEXT]["echo"]
    assert "echo" not in names(TEXT)
