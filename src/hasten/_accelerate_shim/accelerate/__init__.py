"""Stand-in for the ``accelerate`` package: importing it installs hasten under Accelerate's name and replaces this
module with hasten's ``accelerate`` (see ``hasten.accelerate_alias``).

It is found first on the ``PYTHONPATH`` that ``hasten launch --as_accelerate`` gives its processes, and it is the
package of hasten's ``accelerate`` distribution (built from the repository's ``alias/`` folder), which installs it
into an environment for good.
"""

__hasten_accelerate_shim__ = True

try:
    from hasten.accelerate_alias import install_as_accelerate
except ModuleNotFoundError as error:
    if error.name != "hasten":
        raise
    raise ImportError(
        "`accelerate` here is hasten under Accelerate's name, but hasten is not installed: install hasten again, "
        "or remove this stand-in (pip uninstall accelerate) and install HuggingFace's Accelerate.",
        name="accelerate",
    ) from error

install_as_accelerate()
