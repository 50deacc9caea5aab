// Package shm is the raw layer under the store's lease table: an array of
// 64-bit words in a shared memory file (memfd), read and written with
// sequentially consistent atomic operations by the daemon and one client.
//
// It is, with internal/cu, the only package with unsafe: atomic operations
// on memory that another process maps need a *uint64 into the mapping.
// Everything above it sees indices and values only.
package shm

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// WordSize is the size of one word in bytes.
const WordSize = 8

// Words is a mapping of a shared file as an array of 64-bit words.
type Words struct {
	data []byte
	n    int
}

// Create makes a shared memory file of n words, all zero, and maps it
// read-write. name shows in /proc (memfd:name).
func Create(name string, n int) (*Words, *os.File, error) {
	if n <= 0 || n > 1<<24 {
		return nil, nil, fmt.Errorf("shm: %d words: want 1 to %d", n, 1<<24)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, nil, fmt.Errorf("shm: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "memfd:"+name)
	if err := f.Truncate(int64(n) * WordSize); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("shm: sizing: %w", err)
	}
	// Its size is fixed from now on, so a peer that maps it can rely on
	// it (a shrink would turn its accesses into SIGBUS).
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("shm: sealing: %w", err)
	}
	w, err := Map(f, n)
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return w, f, nil
}

// Map maps n words of f read-write. The file must be sealed against
// shrinking (F_SEAL_SHRINK) and hold at least n words: a file that could
// shrink under the mapping is refused.
func Map(f *os.File, n int) (*Words, error) {
	if n <= 0 || n > 1<<24 {
		return nil, fmt.Errorf("shm: %d words: want 1 to %d", n, 1<<24)
	}
	seals, err := unix.FcntlInt(f.Fd(), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: not a sealable memory file: %w", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return nil, errors.New("shm: the file is not sealed against shrinking")
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("shm: fstat: %w", err)
	}
	if st.Size < int64(n)*WordSize {
		return nil, fmt.Errorf("shm: the file holds %d bytes, want %d", st.Size, int64(n)*WordSize)
	}
	data, err := unix.Mmap(int(f.Fd()), 0, n*WordSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: mmap: %w", err)
	}
	return &Words{data: data, n: n}, nil
}

// Len returns the number of words.
func (w *Words) Len() int { return w.n }

func (w *Words) at(i int) *uint64 {
	if i < 0 || i >= w.n {
		panic(fmt.Sprintf("shm: word %d of %d", i, w.n))
	}
	return (*uint64)(unsafe.Pointer(&w.data[i*WordSize]))
}

// Load reads word i.
func (w *Words) Load(i int) uint64 { return atomic.LoadUint64(w.at(i)) }

// Store writes word i.
func (w *Words) Store(i int, v uint64) { atomic.StoreUint64(w.at(i), v) }

// CompareAndSwap sets word i to new if it holds old, and reports whether
// it did.
func (w *Words) CompareAndSwap(i int, old, new uint64) bool {
	return atomic.CompareAndSwapUint64(w.at(i), old, new)
}

// Close unmaps the words. It is idempotent; no method may be called after.
func (w *Words) Close() error {
	if w.data == nil {
		return nil
	}
	err := unix.Munmap(w.data)
	w.data, w.n = nil, 0
	return err
}
