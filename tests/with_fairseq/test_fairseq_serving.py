"""Serving a fairseq checkpoint (``lightgen serve model.pt --fairseq-data DIR``) through the serving core:
text and token ids in, answers equal to the unaccelerated hub's ``translate``/``generate`` for greedy,
beam, IAD and GAD requests; bad requests refused."""

import os

import pytest
import torch

if not os.environ.get("CI"):  # CI installs fairseq (README test command); a skip there would hide a defect
    pytest.importorskip("fairseq", reason="fairseq not installed: pip install -e '.[fairseq]' && "
                                          "lightgen install-fairseq")

from fairseq.models.transformer import TransformerModel  # noqa: E402
from test_fairseq_cli import _lines, drafter_dir, workdir  # noqa: E402, F401  (fixtures)

from lightgen.adapters.fairseq import allow_fairseq_checkpoints  # noqa: E402
from lightgen.serving.core import Generator  # noqa: E402

pytestmark = pytest.mark.fairseq
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def served(workdir, drafter_dir):  # noqa: F811
    generator = Generator.load(workdir / "model.pt", fairseq_data=workdir / "bin", drafter_dir=drafter_dir,
                               max_new_tokens=MAX_NEW_TOKENS)
    allow_fairseq_checkpoints()
    reference = TransformerModel.from_pretrained(str(workdir), checkpoint_file="model.pt",
                                                 data_name_or_path=str(workdir / "bin")).eval()
    return generator, reference


def test_answers_equal_the_unaccelerated_hub(served):
    generator, reference = served
    assert generator.info()["model_type"] == "fairseq-transformer" and generator.info()["drafter"]
    sentences = _lines(8, 4)
    settings = [{}, {"num_beams": 3}, {"decoding": "iad"}, {"decoding": "gad", "max_draft": 4}]
    requests = [dict(text=text, **extra) for extra in settings for text in sentences]
    answers = generator.generate(requests)
    for request, answer in zip(requests, answers, strict=True):
        beam = request.get("num_beams", 1)
        expected = reference.generate([reference.encode(request["text"])], beam=beam, max_len_a=0,
                                      max_len_b=MAX_NEW_TOKENS - 1)[0][0]["tokens"].tolist()
        assert answer == {"output_ids": expected, "text": reference.decode(torch.tensor(expected))}, request
        assert len(expected) <= MAX_NEW_TOKENS
    assert generator.stats()["group_sizes"] == {len(sentences): len(settings)}


def test_token_ids_in_and_bad_requests_refused(served):
    generator, reference = served
    ids = reference.encode(_lines(1, 9)[0]).tolist()
    good, too_long, beams_with_iad = generator.generate([
        {"input_ids": ids}, {"input_ids": ids, "max_new_tokens": MAX_NEW_TOKENS + 1},
        {"input_ids": ids, "decoding": "iad", "num_beams": 2}])
    expected = reference.generate([reference.encode(_lines(1, 9)[0])], beam=1, max_len_a=0,
                                  max_len_b=MAX_NEW_TOKENS - 1)[0][0]["tokens"].tolist()
    assert good["output_ids"] == expected
    assert "'max_new_tokens' must be in [1, 12]" in too_long["error"]
    assert "decoding='iad' is greedy decoding" in beams_with_iad["error"]


def test_a_checkpoint_without_dictionaries_is_a_clear_error(workdir, tmp_path):  # noqa: F811
    (tmp_path / "model.pt").symlink_to(workdir / "model.pt")
    with pytest.raises(FileNotFoundError, match="no fairseq dictionaries"):
        Generator.load(tmp_path / "model.pt")
