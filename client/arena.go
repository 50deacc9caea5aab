package client

import (
	"fmt"
	"os"

	"github.com/cudaipc/cudaipc/protocol/storev1"
	"golang.org/x/sys/unix"
)

// The daemon sends an arena's fd once per connection and mode; afterwards
// placements name the arena by id. So the client keeps the fd and a
// mapping of every arena it was sent for as long as the connection lives,
// and maps again (larger) when a placement says the arena has grown.

type arenaKey struct {
	id       uint64
	writable bool
}

type arena struct {
	key  arenaKey
	file *os.File
	cur  *mapping // newest mapping; older ones live until their last user goes
}

// mapping is one mmap of an arena. refs counts the Objects and Leases that
// use it; it is unmapped when refs is 0 and it is no longer the arena's
// current mapping, or the client is closed.
type mapping struct {
	a    *arena
	data []byte
	refs int
}

// place maps the placement p (with the fds of its packet) and returns the
// mapping with one reference taken. It runs on the holder of the read role
// (reader.go).
func (c *Client) place(p *storev1.Placement, files []*os.File) (*mapping, error) {
	key := arenaKey{p.GetArenaId(), p.GetWritable()}
	end := p.GetOffset() + p.GetSize()
	if end < p.GetOffset() || end > p.GetArenaSize() {
		closeFiles(files)
		return nil, fmt.Errorf("%w: placement [%d, %d) outside arena of %d bytes", ErrInternal, p.GetOffset(), end, p.GetArenaSize())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	a := c.arenas[key]
	if p.GetFdAttached() {
		if len(files) != 1 {
			closeFiles(files)
			return nil, fmt.Errorf("%w: placement says an fd is attached, packet has %d", ErrInternal, len(files))
		}
		if a != nil { // the daemon sent it again: take the new fd
			a.file.Close()
			a.file = files[0]
		} else {
			a = &arena{key: key, file: files[0]}
			c.arenas[key] = a
		}
	} else {
		closeFiles(files)
		if a == nil {
			return nil, fmt.Errorf("%w: placement names arena %d, which this connection was never sent", ErrInternal, key.id)
		}
	}
	if a.cur == nil || uint64(len(a.cur.data)) < p.GetArenaSize() {
		prot := unix.PROT_READ
		if key.writable {
			prot |= unix.PROT_WRITE
		}
		data, err := unix.Mmap(int(a.file.Fd()), 0, int(p.GetArenaSize()), prot, unix.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("%w: mapping arena %d (%d bytes): %v", ErrInternal, key.id, p.GetArenaSize(), err)
		}
		old := a.cur
		a.cur = &mapping{a: a, data: data}
		if old != nil && old.refs == 0 {
			_ = unix.Munmap(old.data)
		}
	}
	a.cur.refs++
	return a.cur, nil
}

// unref drops one reference to m.
func (c *Client) unref(m *mapping) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m.refs--
	if m.refs == 0 && (m.a.cur != m || c.closed) {
		_ = unix.Munmap(m.data)
		m.data = nil
		if m.a.cur == m {
			m.a.cur = nil
		}
	}
}

// unrefSealed lets go of the writable mapping of a sealed shared host
// object. Its arena is the object's alone and is never written again, so
// it is dropped at once: once no writable mapping is left, the daemon
// seals the memory against writes for every reader (docs/hardening.md,
// "Sealed objects").
func (c *Client) unrefSealed(m *mapping) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m.refs--
	if k := m.a.key; m.a.cur == m && c.arenas[k] == m.a {
		c.dropHostArenaLocked(k)
	} else if m.refs == 0 && m.data != nil {
		_ = unix.Munmap(m.data)
		m.data = nil
	}
}

// dropHostArenaLocked unmaps a host arena the daemon freed, unless an
// Object or Lease still uses its mapping (then unref unmaps it later), and
// closes its fd.
func (c *Client) dropHostArenaLocked(k arenaKey) {
	a := c.arenas[k]
	if a == nil {
		return
	}
	delete(c.arenas, k)
	a.file.Close()
	if m := a.cur; m != nil {
		if m.refs == 0 {
			_ = unix.Munmap(m.data)
			m.data = nil
		}
		a.cur = nil // unref unmaps a mapping that is not current
	}
}

// releaseArenasLocked unmaps every mapping nobody uses and closes the fds;
// called by Close once the reader has stopped.
func (c *Client) releaseArenasLocked() {
	for k, a := range c.arenas {
		if a.cur != nil && a.cur.refs == 0 {
			_ = unix.Munmap(a.cur.data)
			a.cur.data = nil
			a.cur = nil
		}
		a.file.Close()
		delete(c.arenas, k)
	}
}

// slice returns the bytes of a placement within m.
func (m *mapping) slice(p *storev1.Placement) []byte {
	off, n := p.GetOffset(), p.GetSize()
	return m.data[off : off+n : off+n]
}
