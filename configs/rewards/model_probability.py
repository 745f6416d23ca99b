"""A `reward.combine` function: the reward model's logit as a probability, the rule left out.

    asyncrl launch reward.model.path=models/arith-rm reward.combine.path=configs/rewards/model_probability.py

A classifier's logit is unbounded: once most of a group's answers are right, their logits
still differ (4.9, 5.3, 6.1), and GRPO's per-group normalisation turns those differences into
advantages of +-1, training on the model's noise. As a probability they are all ~1.0: a group
of right answers carries no signal, as under a 0/1 rule.
"""

import math


def combine(rule_score, model_score, data_source, extra_info):
    if model_score >= 0:  # the logistic function, without overflow either way
        return 1.0 / (1.0 + math.exp(-model_score))
    return math.exp(model_score) / (1.0 + math.exp(model_score))
