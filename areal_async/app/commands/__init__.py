"""The one-shot commands of ``areal-async`` (each imported by ``cli.py`` when it runs): ``doctor``, ``verify``,
``replay``, ``plot``, ``status``, ``data_prepare``/``data_filter``, ``sft``, ``train_only``, ``check_plugin``
(with ``check_workflow_child``). A command may use the workers' builders; no worker imports a command."""
