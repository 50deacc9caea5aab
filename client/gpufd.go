package client

import (
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// GPU objects of a daemon started with --gpu-share fd: every placement
// carries a descriptor of the whole arena (VMM memory, docs/fd-sharing.md)
// and no region. The client imports an arena once (Device.ImportFD) and
// keeps that mapping while any Object or Lease of this client uses it; the
// descriptor is closed at once, since a kept descriptor would keep the
// device memory allocated after the daemon frees the arena. Unlike legacy
// IPC this works from another PID namespace: a container.

// How a placement's memory reaches this process (Object.GPUShare).
const (
	gpuShareHost = ""
	gpuShareIPC  = "ipc"
	gpuShareFD   = "fd"
)

// gpuShareOf says how a placement is shared: host memory (mapped from the
// arena's memfd), a legacy IPC region, or a descriptor of a GPU arena.
func gpuShareOf(p *storev1.Placement) string {
	switch {
	case p.GetDevice() == "" || p.GetDevice() == "host":
		return gpuShareHost
	case len(p.GetRegion()) > 0:
		return gpuShareIPC
	}
	return gpuShareFD
}

// fdArena is one GPU arena imported from its descriptor. refs counts the
// Objects and Leases using it; the mapping is closed when it drops to 0.
type fdArena struct {
	c    *Client
	id   uint64
	m    *cudaipc.FDMapping
	refs int // guarded by c.fdMu
}

// fdArenas is the client's cache of imported GPU arenas, by arena id.
type fdArenas struct {
	mu     sync.Mutex // held across ImportFD, so an arena is imported once
	arenas map[uint64]*fdArena
}

// importFD returns the import of the arena of p, made from f on first use,
// with a reference taken for the caller. It closes f.
func (c *Client) importFD(op, name string, p *storev1.Placement, f *os.File) (*fdArena, error) {
	defer f.Close()
	bad := func(format string, args ...any) error {
		return &Error{Op: op, Name: name, Err: ErrInternal, Message: fmt.Sprintf(format, args...)}
	}
	c.fd.mu.Lock()
	defer c.fd.mu.Unlock()
	a := c.fd.arenas[p.GetArenaId()]
	if a == nil {
		dev, err := fdDevice(p.GetDevice())
		if err != nil {
			return nil, bad("mapping the GPU object: %v", err)
		}
		m, err := dev.ImportFD(f, int64(p.GetArenaSize()))
		if err != nil {
			return nil, &Error{Op: op, Name: name, Err: fmt.Errorf("mapping the GPU object: importing the arena's descriptor: %w", err)}
		}
		a = &fdArena{c: c, id: p.GetArenaId(), m: m}
		c.fd.arenas[a.id] = a
	}
	if end := p.GetOffset() + p.GetSize(); end > uint64(a.m.Size()) {
		if a.refs == 0 {
			a.closeLocked()
		}
		return nil, bad("placement [%d, %d) lies outside arena %d's %d-byte mapping", p.GetOffset(), end, a.id, a.m.Size())
	}
	a.refs++
	return a, nil
}

// fdDevice picks the GPU to map an arena of device uuid for: that GPU when
// this process sees it, else its first GPU.
func fdDevice(uuid string) (*cudaipc.Device, error) {
	if u, err := cudaipc.ParseUUID(uuid); err == nil {
		if d, err := cudaipc.DeviceByUUID(u); err == nil {
			return d, nil
		}
	}
	devs, err := cudaipc.Devices()
	if err != nil {
		return nil, err
	}
	if len(devs) == 0 {
		return nil, fmt.Errorf("no GPU visible in this process for %s", uuid)
	}
	return devs[0], nil
}

// unref drops one reference; the last closes the mapping.
func (a *fdArena) unref() error {
	fd := &a.c.fd
	fd.mu.Lock()
	defer fd.mu.Unlock()
	if a.refs--; a.refs > 0 {
		return nil
	}
	return a.closeLocked()
}

func (a *fdArena) closeLocked() error {
	if a.c.fd.arenas[a.id] == a {
		delete(a.c.fd.arenas, a.id)
	}
	return a.m.Close()
}

// closeAll closes the mappings left when the client closes; normally none
// are, since closing the client closes its Objects' and Leases' views.
func (fd *fdArenas) closeAll() {
	fd.mu.Lock()
	defer fd.mu.Unlock()
	for id, a := range fd.arenas {
		_ = a.m.Close()
		delete(fd.arenas, id)
	}
}

// fdView is an object's part of an imported arena.
type fdView struct {
	a   *fdArena
	off int64 // of the object in the arena
}

func (v *fdView) readAt(size int64, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("negative offset %d", off)
	}
	if off >= size {
		if len(p) == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	n := int(min(int64(len(p)), size-off))
	if n == 0 {
		return 0, nil
	}
	if _, err := v.a.m.ReadAt(p[:n], v.off+off); err != nil {
		return 0, err
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}
