"""The ``qemu`` driver's parts: real microVMs for the reference node agent.

``corral agent fcdaemon --driver qemu`` runs every replica as a QEMU ``microvm`` booting
Debian's cloud kernel with an initramfs that holds a Python runtime and the function,
controlled over QMP, reached through a user-mode network forward on the agent's host,
and started warm from a snapshot of its build once one exists. The parts, bottom up:

* :mod:`agents.qemu.cache` - where the cache is, and locks between processes sharing it;
* :mod:`agents.qemu.kernel` - the guest kernel: fetched with apt, unpacked into a cache;
* :mod:`agents.qemu.image` - guest images (initramfs) per function build;
* :mod:`agents.qemu.guest` - the runtime inside each guest (standard library only);
* :mod:`agents.qemu.machine` - QEMU, the accelerator probe (KVM or TCG), the command line;
* :mod:`agents.qemu.qmp` - QMP from the driver's threads;
* :mod:`agents.qemu.control` - the host's end of a guest's control port;
* :mod:`agents.qemu.guests` - one VM's QEMU process, record and monitor; adoption;
* :mod:`agents.qemu.migration` - saving a guest to a snapshot and resuming one, over QMP;
* :mod:`agents.qemu.snapshots` - snapshots per build, refused for any other;
* :mod:`agents.qemu.driver` - :class:`~agents.qemu.driver.QemuDriver`, the
  :class:`~agents.drivers.VMDriver` tying them together.

Nothing here is imported unless the driver is chosen (its libraries, ``qemu.qmp`` and
``lz4``, load only then).
"""
