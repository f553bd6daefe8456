"""Network plumbing that corral's control plane (``workers``) and its reference agents share.

Both sides of corral's wire parse the same addresses, and this package holds what
they have in common, so that neither imports the other: ``workers`` never imports
``agents`` (the agents are a reference implementation, replaceable by anyone's), and
``agents`` never loads the control plane's dependencies. It sits below both and
imports neither, nor :mod:`config`.

* :mod:`netplumb.addresses` - host and port strings: the one parser.
"""
