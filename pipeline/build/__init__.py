"""The build: the config resolved once into a frozen plan (``plan.py``, its models' roles in
``roles/``), then its stages run or taken from the stage cache (``runner.py``) into a version
directory (``versions.py``); what a build would do (``dry_run.py``), what it may cost
(``feasibility.py``), the artifact's ``manifest.json`` (``manifest.py``) and a sweep's report
(``sweep.py``). Importing this package imports none of them."""
