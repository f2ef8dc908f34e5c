"""Can this pod open the AMD GPU device files? One line either way; exit 1 when not.

Run by the chart's `gpu-access` init container as the pod's user before vLLM starts. ROCm opens
/dev/kfd and /dev/dri/renderD*, which keep the node's group owner (its "video"/"render" groups):
when the pod's supplemental groups (rocm.deviceGroups) miss that group, vLLM would fail deep in
ROCm's start-up. Device paths may be given as arguments (tests); TERMINATION_LOG overrides the
termination message file.
"""

import errno
import glob
import os
import sys


def problem(devices):
    if not devices or not os.path.exists(devices[0]):
        return (
            "no /dev/kfd in the container: the pod got no AMD GPU (is the AMD GPU device plugin running on "
            "the node, and does the pod request the GPU resource?)"
        )
    groups = sorted(set(os.getgroups()) | {os.getgid()})
    for path in devices:
        try:
            os.close(os.open(path, os.O_RDWR))
        except OSError as e:
            try:
                gid = os.stat(path).st_gid
            except OSError:
                gid = "?"
            if e.errno in (errno.EACCES, errno.EPERM):
                return (
                    f"cannot open {path}: permission denied; it belongs to group {gid} and the pod runs as uid "
                    f"{os.getuid()} with groups {groups}: add the node's video and render group ids to "
                    "rocm.deviceGroups (on the node: getent group video render, or stat -c %g /dev/kfd)"
                )
            return f"cannot open {path}: {e.strerror} (errno {e.errno})"
    return None


def main(argv):
    devices = argv or ["/dev/kfd", *sorted(glob.glob("/dev/dri/renderD*"))]
    message = problem(devices)
    if message is None:
        print(f"GPU device files open as uid {os.getuid()}: {', '.join(devices)}")
        return 0
    print(message, file=sys.stderr)
    try:
        with open(os.environ.get("TERMINATION_LOG", "/dev/termination-log"), "w") as log:
            log.write(message + "\n")
    except OSError:
        pass  # the message is on stderr (FallbackToLogsOnError shows it too)
    return 1


sys.exit(main(sys.argv[1:]))
