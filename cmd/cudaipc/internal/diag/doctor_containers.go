package diag

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
)

// gpuContainerChecks reports, per GPU, what decides how its memory can
// cross container boundaries (docs/containers.md): VMM descriptors, stream
// memory operations and read-only mappings.
func gpuContainerChecks(devs []*cudaipc.Device, add func(name, status, detail string)) {
	for _, d := range devs {
		var have, lack []string
		sort := func(ok bool, what string) {
			if ok {
				have = append(have, what)
			} else {
				lack = append(lack, what)
			}
		}
		sort(d.VMMFDSupported(), "VMM POSIX-fd export (sharing across PID namespaces)")
		sort(d.StreamMemOpsSupported(), "64-bit stream memory operations (Timeline ordering without IPC events)")
		ro, err := cudaipc.ReadOnlyMappingSupported(d)
		switch {
		case err != nil:
			lack = append(lack, "read-only mappings (probe failed: "+err.Error()+")")
		default:
			sort(ro, "read-only mappings of shared memory (CU_MEM_ACCESS_FLAGS_PROT_READ)")
		}
		st, detail := "ok", ""
		if len(have) > 0 {
			detail = "has " + strings.Join(have, ", ")
		}
		if len(lack) > 0 {
			st = "warn"
			if detail != "" {
				detail += "; "
			}
			detail += "lacks " + strings.Join(lack, ", ")
		}
		add(fmt.Sprintf("GPU %d containers", d.Ordinal()), st, detail)
	}
}

// processChecks reports what needs no driver: the process's IPC namespace,
// its capabilities and its /dev/shm.
func processChecks(add func(name, status, detail string)) {
	ipc, _ := os.Readlink("/proc/self/ns/ipc")
	initIPC, ierr := os.Readlink("/proc/1/ns/ipc")
	detail := ipc
	switch {
	case ierr != nil:
		detail += " (cannot see pid 1's)"
	case initIPC != ipc:
		detail += " (not pid 1's: a private IPC namespace)"
	}
	add("ipc namespace", "ok", detail+": legacy IPC events are opened through /dev/shm and need a peer that sees the same one")

	add(capabilityCheck())
	add(shmCheck())
}

// capSysPtrace is CAP_SYS_PTRACE's bit in the capability sets.
const capSysPtrace = 19

func capabilityCheck() (string, string, string) {
	const name = "capabilities"
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return name, "skip", err.Error()
	}
	var eff uint64
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			eff, _ = strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	detail := fmt.Sprintf("uid %d, CapEff %#x", os.Geteuid(), eff)
	if eff&(1<<capSysPtrace) != 0 {
		detail += ": has CAP_SYS_PTRACE (pidfd_getfd may work here; cudaipc does not need it)"
	} else {
		detail += ": no CAP_SYS_PTRACE, so no pidfd_getfd on other processes (PyTorch's expandable-segment IPC needs it; cudaipc passes descriptors over its socket instead)"
	}
	return name, "ok", detail
}

func shmCheck() (string, string, string) {
	const name = "/dev/shm"
	var fs unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &fs); err != nil {
		return name, "warn", err.Error() + ": no /dev/shm; IPC events will not work, Timelines will"
	}
	var st unix.Stat_t
	unix.Stat("/dev/shm", &st)
	size := fs.Blocks * uint64(fs.Bsize)
	kind := "not tmpfs"
	if fs.Type == unix.TMPFS_MAGIC {
		kind = "tmpfs"
	}
	return name, "ok", fmt.Sprintf("%s, %d MiB, device %d:%d: processes share IPC events only if they see this same /dev/shm (Docker --ipc=host or shareable); cudaipc Timelines need none",
		kind, size>>20, unix.Major(st.Dev), unix.Minor(st.Dev))
}
