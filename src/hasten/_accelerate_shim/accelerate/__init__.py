"""Stand-in for the ``accelerate`` package, found first on the ``PYTHONPATH`` that ``hasten launch
--as_accelerate`` gives its processes: importing it installs hasten under Accelerate's name and
replaces this module with hasten's ``accelerate`` (see ``hasten.accelerate_alias``)."""

__hasten_accelerate_shim__ = True

from hasten.accelerate_alias import install_as_accelerate  # noqa: E402

install_as_accelerate()
