"""What only the Triton truncation thresholds can get wrong: the bisection's threshold is a logit
of its row with its ties, for 16-bit keys too; rows that are not truncated; the fused head's
chunked logits (chunk boundaries change no threshold) and its thresholds' margin.  The values
and gradients against the reference: tests/test_sampling_truncation.py."""

import pytest
import tiers
import torch

pytest.importorskip("triton")

from ppo_fast._sampling import Truncation  # noqa: E402
from ppo_fast.backends.reference.token_logprobs import kept_tokens  # noqa: E402
from ppo_fast.backends.triton import linear_token_logprobs as tlin  # noqa: E402
from ppo_fast.backends.triton import token_logprobs as tlp  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "dtype, top_k",
    tiers.sampled(
        [
            pytest.param(d, k, id=f"{str(d)[6:]}-{k}")
            for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
            for k in (1, 7, 40)
        ],
        strength=1,
    ),
)
def test_top_k_threshold_is_the_kth_value_with_its_ties(dtype, top_k):
    logits = (torch.randn(9, 131, device=DEVICE) * 3).round().to(dtype)  # integer logits: ties everywhere
    logits[0] = 2.0  # one all-equal row: every token is kept
    logits[1, ::2] = -0.0  # -0.0 and +0.0 are one value
    labels = torch.zeros(9, dtype=torch.long, device=DEVICE)
    tau = tlp.truncation_thresholds(logits, labels, 0.8, -100, Truncation(top_k=top_k))
    x = logits.double()
    assert (tau.double()[:, None] == x).any(1).all()  # a logit of its row
    larger = (x > tau.double()[:, None]).sum(1)
    at_least = (x >= tau.double()[:, None]).sum(1)
    assert (larger < top_k).all() and (at_least >= top_k).all()
    assert at_least[0] == 131
    assert torch.equal(x >= tau.double()[:, None], kept_tokens(x / 0.8, Truncation(top_k=top_k)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_min_p_edge_is_the_other_backends_rule(dtype):
    """Probabilities exactly min_p times the largest (1, 1/2, 1/4 of it): kept as exp(z - max z) >= min_p
    keeps them, the difference rounded in the compute dtype and the exp in float64 (the reference's and
    the native kernels' rule), not as log2-space products would round them."""
    logits = torch.log(torch.tensor([1.0, 0.5, 0.25, 0.1], dtype=torch.float64)).to(dtype).to(DEVICE)
    for min_p in (0.5, 0.25, 0.1):
        truncation = Truncation(min_p=min_p)
        tau = tlp.truncation_thresholds(
            logits[None], torch.zeros(1, dtype=torch.long, device=DEVICE), 1.0, -100, truncation
        )
        assert torch.equal(logits >= tau, kept_tokens(logits[None], truncation)[0]), min_p


def test_rows_not_truncated_get_minus_inf():
    logits = torch.randn(4, 33, device=DEVICE)
    logits[0, 3] = torch.nan
    logits[1, 5] = torch.inf
    logits[2] = -torch.inf
    labels = torch.tensor([0, 0, 0, -100], device=DEVICE)  # the last row is ignored
    tau = tlp.truncation_thresholds(logits, labels, 1.0, -100, Truncation(top_k=2, top_p=0.5))
    assert torch.isneginf(tau).all()


@pytest.mark.parametrize("softcap", [None, pytest.param(2.5, marks=pytest.mark.full)])  # the soft-cap: the matrix
def test_fused_head_thresholds_chunked_and_with_a_margin(softcap):
    n, width, vocab = 34, 8, 67  # past the forward's 32-row tile: chunks of 32 and 2 rows
    hidden, weight = torch.randn(n, width, device=DEVICE), torch.randn(vocab, width, device=DEVICE)
    labels = torch.randint(0, vocab, (n,), device=DEVICE)
    labels[5] = -100
    t = Truncation(top_k=6, top_p=0.8)
    options = dict(temperature=0.9, logit_scale=1.5, logit_softcap=softcap, ignore_index=-100, truncation=t)
    whole = tlin.linear_truncation_thresholds(hidden, weight, labels, None, **options)
    chunked = tlin.linear_truncation_thresholds(hidden, weight, labels, None, **options, scratch_bytes=1)
    assert torch.equal(whole, chunked)  # a chunk of BLOCK_N rows at a time: the same thresholds
    assert torch.isneginf(whole[5])
    u = tlin.linear_logits_rows(
        hidden, weight, labels, None, 0, n, logit_scale=1.5, logit_softcap=softcap, ignore_index=-100
    )
    used = labels != -100
    kept = u >= whole[:, None]
    assert not (u == whole[:, None])[used].any()  # halfway between two values of the row: a margin both ways
    post = (softcap if softcap is not None else 1.5) / 0.9
    assert torch.equal(kept[used], kept_tokens(u.double() * post, t)[used])
