"""The drop-in as a transformers Hub ``custom_generate`` folder (recspec.hf.custom_generate_path):
``generate(custom_generate=<the folder>, trust_remote_code=True, item_index=..., tokenizer=...)``
loads its ``custom_generate/generate.py`` the way transformers loads a Hub recipe and returns what
the callable drop-in returns (and so what constrained ``generate`` returns), on the
MovieLens-trained target; the folder holds what transformers looks for; a streamer is refused
as transformers refuses one with beam search."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recspec.hf import custom_generate_path, trie_beam_search
from tests.test_dropin_contract import Peer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def peer(trained_models: Path) -> Peer:
    return Peer(trained_models / "target")


def test_the_folder_has_the_hub_layout() -> None:
    folder = custom_generate_path()
    assert (folder / "custom_generate" / "generate.py").is_file()
    assert (folder / "custom_generate" / "requirements.txt").read_text().split() == ["recspec", "transformers>=5.0"]
    assert "- custom_generate" in (folder / "README.md").read_text()  # the Hub tag that lists such repositories


@pytest.mark.parametrize("arguments", [
    dict(),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
    dict(decoder="beam", batch_size=16),
])
def test_custom_generate_folder_returns_what_the_drop_in_returns(peer: Peer, trained_models: Path,
                                                                 arguments: dict) -> None:
    options = {name: arguments.pop(name) for name in ("decoder", "batch_size") if name in arguments}
    index = trained_models / "target" / "item_index.json"
    folder = peer.generate(custom_generate=str(custom_generate_path()), trust_remote_code=True, item_index=str(index),
                           tokenizer=peer.tokenizer, **options, **arguments)
    drop_in = peer.generate(custom_generate=trie_beam_search(peer.index, peer.tokenizer, **options), **arguments)
    assert torch.equal(folder.sequences, drop_in.sequences)
    torch.testing.assert_close(folder.sequences_scores, drop_in.sequences_scores, rtol=0, atol=0)
    peer.assert_same(folder, peer.generate(prefix_allowed_tokens_fn=peer.allowed, **arguments))


def test_the_folder_needs_trust_and_refuses_a_streamer(peer: Peer, trained_models: Path) -> None:
    from transformers import TextStreamer

    index = str(trained_models / "target" / "item_index.json")
    with pytest.raises(ValueError, match="trust_remote_code"):  # transformers' own gate on running a folder's code
        peer.generate(users=2, custom_generate=str(custom_generate_path()), item_index=index, tokenizer=peer.tokenizer)
    with pytest.raises(ValueError, match="`streamer` cannot be used with recspec's trie beam search"):
        peer.generate(users=1, custom_generate=str(custom_generate_path()), trust_remote_code=True, item_index=index,
                      tokenizer=peer.tokenizer, streamer=TextStreamer(peer.tokenizer))
    with pytest.raises(ValueError, match="needs item_index="):
        peer.generate(users=1, custom_generate=str(custom_generate_path()), trust_remote_code=True,
                      tokenizer=peer.tokenizer)
