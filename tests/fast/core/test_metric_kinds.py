"""How a step's parts' metrics are put together (eddyrl/metric_kinds.py): maxima stay maxima,
totals add up, the rest are means over the parts."""

from eddyrl.metric_kinds import combine_parts, is_maximum, is_total


def test_each_kind_is_put_together_its_way():
    parts = [{"loss": 1.0, "mismatch_max_abs": 0.5, "mismatch_abs_sum": 2.0,
              "mismatch_tokens": 10.0, "skipped_updates": 1.0, "train_compute_s": 3.0,
              "buddy_copy_s_max": 0.2},
             {"loss": 3.0, "mismatch_max_abs": 0.25, "mismatch_abs_sum": 1.0,
              "mismatch_tokens": 6.0, "skipped_updates": 0.0, "train_compute_s": 4.0,
              "buddy_copy_s_max": 0.4}]
    assert combine_parts(parts) == {"loss": 2.0, "mismatch_max_abs": 0.5,
                                    "mismatch_abs_sum": 3.0, "mismatch_tokens": 16.0,
                                    "skipped_updates": 1.0, "train_compute_s": 7.0,
                                    "buddy_copy_s_max": 0.4}


def test_a_mean_is_over_the_parts_that_report_it_and_one_part_is_itself():
    assert combine_parts([{"loss": 2.0}, {}]) == {"loss": 2.0}
    one = {"loss": 1.5, "grad_norm": 0.3, "tokens": 7.0, "kl_ref_max": 0.1}
    assert combine_parts([one]) == one
    assert combine_parts([]) == {}


def test_names_decide_the_kind():
    assert is_maximum("mismatch_max_abs") and is_maximum("buddy_wait_s_max")
    assert not is_total("buddy_wait_s_max")  # a maximum of seconds, not a total
    assert is_total("skipped_updates") and is_total("logprob_old_s") and is_total("train_tokens")
    assert not is_total("tokens") and not is_total("is_ess") and not is_maximum("loss")


def test_a_record_that_is_not_a_number_is_the_last_parts():
    # the elastic pool's replicas_lost: {worker: reason}, passed through as it was
    assert combine_parts([{"replicas_lost": {"2": "actor died"}, "loss": 1.0}]) == \
        {"replicas_lost": {"2": "actor died"}, "loss": 1.0}
    assert combine_parts([{"flag": True}, {"flag": False}]) == {"flag": False}
