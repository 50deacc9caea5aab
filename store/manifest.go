package store

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/bundle"
)

// manifest is a bundle's manifest: a memfd the creator writes and the
// daemon seals (F_SEAL_WRITE) and validates before the object is sealed;
// readers get a descriptor of it with every lease.
type manifest struct {
	f       *os.File
	size    int64 // the header's bytes
	sources int64 // a no-copy version's sources table, after the header (sources.go)
	table   []byte
	tensors int
	sealed  bool
	// charged is the store its descriptor is charged to (budget.go), owner
	// the uid; nil until charged.
	charged *Store
	owner   uint32
}

// close closes the manifest's descriptor, and gives its charge back. The
// store's lock must be held once it is charged.
func (m *manifest) close() {
	if m != nil && m.f != nil {
		m.f.Close()
		m.f = nil
		if m.charged != nil {
			m.charged.giveFDsLocked(m.owner, 1)
			m.charged = nil
		}
	}
}

func newManifest(size, sources int64) (*manifest, error) {
	fd, err := unix.MemfdCreate("cudaipc-manifest", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "memfd:cudaipc-manifest")
	if err := unix.Ftruncate(fd, size+sources); err != nil {
		f.Close()
		return nil, fmt.Errorf("manifest: ftruncate: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		f.Close()
		return nil, fmt.Errorf("manifest: seal size: %w", err)
	}
	return &manifest{f: f, size: size, sources: sources}, nil
}

// dup returns a new descriptor of the manifest, for a reply.
func (m *manifest) dup() (*os.File, error) {
	fd, err := unix.FcntlInt(m.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup manifest fd: %w", err)
	}
	return os.NewFile(uintptr(fd), m.f.Name()), nil
}

// finish makes the manifest immutable and checks it against an object of
// size bytes, unless checked holds the same bytes checked against the same
// size. It runs without Store.mu: the file is the object's alone.
func (m *manifest) finish(size int64, checked *manifestCache) error {
	if _, err := unix.FcntlInt(m.f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_WRITE|unix.F_SEAL_SEAL); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return invalidf("the manifest is still mapped writable: unmap it before seal")
		}
		return fmt.Errorf("manifest: seal: %w", err)
	}
	all := make([]byte, m.size+m.sources)
	if _, err := m.f.ReadAt(all, 0); err != nil {
		return fmt.Errorf("manifest: read: %w", err)
	}
	buf := all[:m.size:m.size]
	m.table = all[m.size:]
	if n, ok := checked.lookup(buf, size); ok {
		m.tensors = n
		m.sealed = true
		return nil
	}
	man, err := bundle.Parse(buf)
	if err == nil {
		err = man.Check(size)
	}
	if err != nil {
		return invalidf("manifest: %v", err)
	}
	m.tensors = len(man.Tensors)
	m.sealed = true
	checked.add(buf, size, m.tensors)
	return nil
}

// manifestCache remembers the last manifests that passed the check (their
// bytes, the object size they were checked against, their tensor count), so
// that the next version of a model, whose header is the same, is not parsed
// again: parsing 18,867 tensors takes tens of milliseconds, and it lies
// between a publish and its readers. Identical bytes and size give the same
// verdict, and comparing 2 MB costs a fraction of a millisecond.
type manifestCache struct {
	mu      sync.Mutex
	entries []checkedManifest // newest last
	bytes   int
	parsed  int // manifests parsed and added (for tests)
	hits    int
}

type checkedManifest struct {
	raw     []byte
	size    int64
	tensors int
}

const (
	manifestCacheEntries = 4
	manifestCacheBytes   = 64 << 20
)

func (c *manifestCache) lookup(raw []byte, size int64) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(c.entries) - 1; i >= 0; i-- {
		e := c.entries[i]
		if e.size == size && bytes.Equal(e.raw, raw) {
			c.hits++
			return e.tensors, true
		}
	}
	return 0, false
}

func (c *manifestCache) add(raw []byte, size int64, tensors int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.parsed++
	if len(raw) > manifestCacheBytes {
		return
	}
	c.entries = append(c.entries, checkedManifest{raw: raw, size: size, tensors: tensors})
	c.bytes += len(raw)
	for len(c.entries) > manifestCacheEntries || c.bytes > manifestCacheBytes {
		c.bytes -= len(c.entries[0].raw)
		c.entries[0] = checkedManifest{}
		c.entries = c.entries[1:]
	}
}
