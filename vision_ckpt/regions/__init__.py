"""Regions on a model: rules compiled to regions, recorded by ``plan`` and installed by ``apply``.

``apply`` decides, from a config and a model, which modules are checkpointed at which level and
how (``plan``), and puts that on the model or takes it off (``apply``, ``apply_preset``,
``remove``); ``_plan_record`` holds the plan it records, ``_planning`` the resolution of rules
into it, and ``_install`` the forwards it installs. It imports the config and the runtime,
never the measurement or tuning layers.
"""
