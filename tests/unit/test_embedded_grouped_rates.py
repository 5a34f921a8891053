"""grouped_rates: the per-group success rates both embedded tasks report after a warm-start build."""

from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.embedded.warmstart import grouped_rates


def test_grouped_rates_names_and_values():
    qs = [{"hops": 2}, {"hops": 1}, {"hops": 2}, {"hops": 2}]
    out = grouped_rates(qs, [1.0, 0.0, 0.0, 1.0], "hops", "em", "{}hop")
    assert list(out) == ["em_1hop", "n_1hop", "em_2hop", "n_2hop"]
    assert out == {"em_1hop": 0.0, "n_1hop": 1, "em_2hop": 2 / 3, "n_2hop": 3}
    assert grouped_rates([{"type": "drug"}], [1.0], "type", "success") == {"success_drug": 1.0, "n_drug": 1}


@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from([0.0, 1.0])), min_size=1, max_size=40))
def test_grouped_rates_recompose_the_overall_mean(pairs):
    qs = [{"k": k} for k, _ in pairs]
    scores = [s for _, s in pairs]
    out = grouped_rates(qs, scores, "k", "r")
    groups = sorted({k for k, _ in pairs})
    assert sum(out[f"n_{g}"] for g in groups) == len(pairs)
    total = sum(out[f"r_{g}"] * out[f"n_{g}"] for g in groups)
    assert abs(total - sum(scores)) <= 1e-12 * len(pairs)
