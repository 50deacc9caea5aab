package client

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Registered host memory is mapped once per client and memfd: leases of
// it share the mapping, and the client keeps it after the last one ends,
// idle (at most maxIdleHost, the least recently used unmapped first), so
// that repeated reads (a KV space's) neither map the memory again nor
// fault its pages in again. An idle mapping keeps its memfd's memory
// allocated after its registrant is gone, until the bound or Close
// unmaps it.

// maxIdleHost bounds the idle mappings of registered host memory a client
// keeps.
const maxIdleHost = 64

// hostKey names a memfd: its device and inode, unique while any mapping
// of it (such as the cached one) holds it.
type hostKey struct{ dev, ino uint64 }

// hostMapping is a read-only mapping of one memfd. Guarded by Client.mu.
type hostMapping struct {
	c      *Client
	key    hostKey
	data   []byte
	refs   int
	cached bool   // in c.hostMaps
	used   uint64 // when its last user ended, in c.hostClock ticks: the LRU order
}

// mapHostExternal maps the registered host memory of placement p, whose
// memfd is files[0], read-only into v, through the client's cache. It
// closes files.
func (c *Client) mapHostExternal(name string, p *storev1.Placement, files []*os.File, v *view) error {
	defer closeFiles(files)
	bad := func(format string, a ...any) error {
		return &Error{Op: "get", Name: name, Err: ErrInternal, Message: fmt.Sprintf(format, a...)}
	}
	if len(files) != 1 {
		return bad("registered host memory came with %d descriptors, not its memfd", len(files))
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(files[0].Fd()), &st); err != nil {
		return &Error{Op: "get", Name: name, Err: fmt.Errorf("registered host memory's memfd: %w", err)}
	}
	size := int64(p.GetSize())
	if st.Size < size {
		return bad("registered host memory of %d bytes in a memfd of %d", size, st.Size)
	}
	key := hostKey{st.Dev, st.Ino}
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.hostMaps[key]
	if m == nil || int64(len(m.data)) < size {
		b, err := unix.Mmap(int(files[0].Fd()), 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return &Error{Op: "get", Name: name, Err: fmt.Errorf("mapping registered host memory: %w", err)}
		}
		if m != nil { // the memfd grew: the new mapping replaces it
			m.cached = false
			if m.refs == 0 {
				_ = unix.Munmap(m.data)
			}
		}
		m = &hostMapping{c: c, key: key, data: b, cached: !c.closed}
		if m.cached {
			if c.hostMaps == nil {
				c.hostMaps = make(map[hostKey]*hostMapping)
			}
			c.hostMaps[key] = m
		}
	}
	m.refs++
	v.host, v.data = m, m.data[:size:size]
	return nil
}

// release ends a user of m: an uncached mapping goes with its last user;
// a cached one stays, idle, within the bound.
func (m *hostMapping) release() {
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	m.refs--
	if m.refs > 0 {
		return
	}
	if !m.cached {
		_ = unix.Munmap(m.data)
		return
	}
	c.hostClock++
	m.used = c.hostClock
	idle := 0
	var oldest *hostMapping
	for _, o := range c.hostMaps {
		if o.refs == 0 {
			idle++
			if oldest == nil || o.used < oldest.used {
				oldest = o
			}
		}
	}
	if idle > maxIdleHost {
		delete(c.hostMaps, oldest.key)
		_ = unix.Munmap(oldest.data)
	}
}

// dropHostMapsLocked unmaps the idle mappings and leaves the rest to their
// last user (Close).
func (c *Client) dropHostMapsLocked() {
	for k, m := range c.hostMaps {
		m.cached = false
		if m.refs == 0 {
			_ = unix.Munmap(m.data)
		}
		delete(c.hostMaps, k)
	}
}
