package store

import (
	"errors"
	"fmt"
	"os"

	"github.com/cudaipc/cudaipc/protocol/storev1"
	"golang.org/x/sys/unix"
)

// hostDevice is the only device of the host backend.
const hostDevice = "host"

// hostBackend keeps objects in memfd arenas: anonymous shared memory that
// clients map from the file descriptor they are sent, so reading an object
// costs no copy.
type hostBackend struct{}

func (hostBackend) name() string { return "host" }

func (hostBackend) device(requested string) (string, error) {
	if requested == "" || requested == hostDevice {
		return hostDevice, nil
	}
	return "", invalidf("device %q: this daemon has no GPU backend, only host memory (it runs --backend host, or --backend auto found no GPU): GPU objects need 'cudaipc serve --backend auto' (or cuda) on a machine with a GPU and its driver", requested)
}

func (hostBackend) granularity(string) int64 { return int64(os.Getpagesize()) }

// keepsArenas is false: a host arena costs little to create and map, and
// the memory of an empty one is better given back to the system.
func (hostBackend) keepsArenas(string) bool { return false }

func (hostBackend) newArena(_ string, id uint64, size int64) (arena, error) {
	fd, err := unix.MemfdCreate(fmt.Sprintf("cudaipc-arena-%d", id), unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	rw := os.NewFile(uintptr(fd), fmt.Sprintf("memfd:cudaipc-arena-%d", id))
	fail := func(op string, err error) (arena, error) {
		rw.Close()
		return nil, fmt.Errorf("arena %d: %s: %w", id, op, err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		return fail("ftruncate", err)
	}
	// A writer could otherwise shrink the file under every reader's
	// mapping and make their next access fault (SIGBUS). F_SEAL_SEAL is
	// left off so that the arena of a sealed shared object can be sealed
	// against writes (sealWrites); only the owner's connections hold a
	// writable descriptor, so only they could add a seal, and a write seal
	// harms nobody else (readers' mappings are read-only).
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		return fail("seal size", err)
	}
	rofd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail("reopen read-only", err)
	}
	ro := os.NewFile(uintptr(rofd), fmt.Sprintf("memfd:cudaipc-arena-%d (read-only)", id))
	// A memfd's inode is created with mode 0777, so a reader could reopen
	// its read-only descriptor for writing through /proc/self/fd. Mode 0
	// leaves that to root only; descriptors already open keep working.
	if err := unix.Fchmod(fd, 0); err != nil {
		ro.Close()
		return fail("fchmod", err)
	}
	return &hostArena{rw: rw, ro: ro, size: size}, nil
}

// hostArena is a memfd, with a read-write and a read-only descriptor.
type hostArena struct {
	rw, ro *os.File
	size   int64
	// writeSealed is set once F_SEAL_WRITE is on: no one, root included,
	// can change the memory through any mapping or descriptor.
	writeSealed bool
}

// sealWrites adds F_SEAL_WRITE, which the kernel grants only once no
// writable shared mapping of the memfd exists (EBUSY before). Until then
// F_SEAL_FUTURE_WRITE stops new writable mappings and writes through a
// descriptor, but a mapping made before the seal stays writable: nothing
// the daemon can do revokes it. It is tried again each time it is asked,
// so that it holds from the first time after the creator unmaps.
func (a *hostArena) sealWrites() bool {
	if a.writeSealed {
		return true
	}
	fd := a.rw.Fd()
	if _, err := unix.FcntlInt(fd, unix.F_ADD_SEALS, unix.F_SEAL_WRITE|unix.F_SEAL_FUTURE_WRITE); err == nil {
		a.writeSealed = true
		return true
	}
	_, _ = unix.FcntlInt(fd, unix.F_ADD_SEALS, unix.F_SEAL_FUTURE_WRITE) // best effort: Linux >= 5.1
	return false
}

func (a *hostArena) share(writable bool) (arenaShare, error) {
	f := a.ro
	if writable {
		f = a.rw
	}
	// A duplicate, so that the caller can close it after sending while the
	// store keeps the arena.
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return arenaShare{}, fmt.Errorf("dup arena fd: %w", err)
	}
	return arenaShare{file: os.NewFile(uintptr(fd), f.Name())}, nil
}

func (*hostArena) placementKind() storev1.Placement_Kind { return storev1.Placement_HOST }

func (a *hostArena) discard(off, n int64) {
	// Only whole pages can go back to the kernel.
	page := int64(os.Getpagesize())
	start := (off + page - 1) / page * page
	end := min((off+n)/page*page, a.size)
	if end > start {
		// Best effort: the memory is merely kept longer if this fails.
		_ = unix.Fallocate(int(a.rw.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, start, end-start)
	}
}

// descriptors: the read-write and the read-only descriptor.
func (*hostArena) descriptors() int { return 2 }

func (a *hostArena) close() error {
	return errors.Join(a.rw.Close(), a.ro.Close())
}

func (hostBackend) arenaSizes(string) (first, most int64) { return 0, 0 }

func (*hostArena) objectRegion(_, _ int64) []byte { return nil }
