"""Regions on a model: rules compiled to regions, recorded by ``plan`` and installed by ``apply``.

``apply`` decides, from a config and a model, which modules are checkpointed at which level and
how (``plan``), and puts that on the model or takes it off (``apply``, ``apply_preset``,
``remove``); ``_plan_record`` holds the plan it records, ``_planning`` the resolution of rules
into it, and ``_install`` the forwards it installs. It imports the config and the runtime,
never the measurement or tuning layers.

Its public names are the plan's types, ``CheckpointPlan`` and its rows, ``PlanEntry``. The
functions ``plan``, ``apply``, ``apply_preset`` and ``remove`` are defined in
:mod:`vision_ckpt.regions.apply` and used from the top level (``vision_ckpt.apply``), so that
the module ``apply`` keeps its name here.

>>> import torch, vision_ckpt
>>> from vision_ckpt.regions import CheckpointPlan, PlanEntry
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
>>> rules = [{"match": "0", "level": 1}, {"match": "2", "level": 3}]
>>> the_plan = vision_ckpt.plan(model, {"training_checkpoint_level": 2, "rules": rules})
>>> isinstance(the_plan, CheckpointPlan)
True
>>> [(e.name, int(e.level), e.checkpointed) for e in the_plan.entries]
[('0', 1, True), ('2', 3, False)]
"""

from ._plan_record import CheckpointPlan as CheckpointPlan, PlanEntry as PlanEntry

__all__ = ["CheckpointPlan", "PlanEntry"]
