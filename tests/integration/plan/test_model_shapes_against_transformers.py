"""eddyrl/plan/shapes.py: parameter counts, read from config.json alone, equal transformers'
own for each kind of model (shape_cases.py), built on the meta device. (The shape's own rules
and errors: test_model_shapes.py.)"""

import pytest
import torch
from shape_cases import CASES

from eddyrl.plan.shapes import shape_from_config


@pytest.mark.parametrize("name", sorted(CASES))
def test_parameter_count_is_transformers_own(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(CASES[name])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):  # shapes only: no memory, milliseconds
        model = AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(CASES[name])
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    layers = model.model.layers
    assert [shape.layer_parameters(i) for i in range(len(layers))] == [
        sum(p.numel() for p in layer.parameters()) for layer in layers]
