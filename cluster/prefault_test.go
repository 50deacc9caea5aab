package cluster

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/internal/testutil"
)

// A replica's fresh shared mapping (a memfd, as the store's arenas) is
// mapped in by prefault, from an unaligned start as objects lie in arenas,
// without changing bytes already written into it.
func TestPrefaultMapsInWithoutChangingBytes(t *testing.T) {
	for _, workers := range []int{1, 3} {
		t.Run(fmt.Sprintf("workers=%d", workers), func(t *testing.T) { testPrefault(t, workers) })
	}
}

func testPrefault(t *testing.T, workers int) {
	const size = 40 << 20
	fd, err := unix.MemfdCreate("prefault-test", 0)
	if err != nil {
		t.Skipf("memfd_create: %v", err)
	}
	f := os.NewFile(uintptr(fd), "prefault-test")
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	whole, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(whole)
	if err := unix.Madvise(whole[:4096], unix.MADV_POPULATE_WRITE); err != nil {
		t.Skipf("MADV_POPULATE_WRITE: %v (Linux 5.14+)", err)
	}
	dst := whole[256 : size-256] // 256-byte aligned, as the store's objects
	// Bytes the GETs already wrote, here and there, before and while
	// prefault runs.
	want := make([]byte, len(dst))
	for _, off := range []int{0, 5 << 20, 20<<20 + 100, len(dst) - 4096} {
		_, _ = rand.Read(want[off : off+4096])
		copy(dst[off:off+4096], want[off:off+4096])
	}
	stop := prefaultWith(dst, workers)
	defer stop()
	_, _ = rand.Read(want[30<<20 : 30<<20+8192])
	copy(dst[30<<20:30<<20+8192], want[30<<20:30<<20+8192])

	testutil.Eventually(t, 10*time.Second, func() error {
		rss, err := mappedBytes(whole)
		if err != nil {
			return err
		}
		// The first page of whole lies before dst's first page boundary
		// and faults as usual; every page from there on is mapped in.
		if rss < size-os.Getpagesize() {
			return fmt.Errorf("%d of %d bytes mapped in", rss, size)
		}
		return nil
	})
	stop()
	stop() // idempotent
	if !bytes.Equal(dst, want) {
		t.Fatal("prefault changed the replica's bytes")
	}
}

// mappedBytes is the Rss of the mapping that starts at m's first byte, from
// /proc/self/smaps.
func mappedBytes(m []byte) (int, error) {
	b, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return 0, err
	}
	start := fmt.Sprintf("%x-", reflect.ValueOf(m).Pointer())
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && !strings.HasSuffix(f[0], ":") { // a mapping's header: start-end perms ...
			in = strings.HasPrefix(line, start)
			continue
		}
		if kb, ok := strings.CutPrefix(line, "Rss:"); in && ok {
			n, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(kb, "kB")))
			return n << 10, err
		}
	}
	return 0, fmt.Errorf("no mapping at %s in /proc/self/smaps", start)
}
