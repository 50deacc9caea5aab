package staging

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
)

// populateStep is how much one madvise call of populate faults in.
const populateStep = 64 << 20

// AllocPinned returns n bytes of page-locked host memory for dev's copies,
// and the function that frees it (once). It maps anonymous memory (huge
// pages where the kernel has them), faults its pages in from every CPU at
// once, then page-locks and registers it with the driver
// (cuMemHostRegister). cuMemAllocHost does the same work from one thread
// in 4 KiB pages, which for the gigabytes a GPU object's staging takes
// costs seconds. Where the driver does not register the memory, it falls
// back to cuMemAllocHost.
func AllocPinned(dev *cudaipc.Device, n int64) ([]byte, func() error, error) {
	return allocPinned(dev, n, pinnedHugePages)
}

// pinnedHugePages says whether AllocPinned asks for transparent huge
// pages (MADV_HUGEPAGE) before faulting its mapping in: 512 times fewer
// faults, and pages the driver pins 2 MiB at a time: several times faster
// than 4 KiB pages or cuMemAllocHost for a large buffer (docs/benchmarks.md,
// "Inside the pull"). Where THP is off the advice does nothing; where the
// kernel finds no huge page it falls back to 4 KiB pages.
const pinnedHugePages = true

func allocPinned(dev *cudaipc.Device, n int64, huge bool) ([]byte, func() error, error) {
	if n <= 0 || int64(int(n)) != n {
		return nil, nil, fmt.Errorf("staging: pinned buffer of %d bytes", n)
	}
	mem, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, nil, fmt.Errorf("staging: map %d bytes: %w", n, err)
	}
	if huge {
		_ = unix.Madvise(mem, unix.MADV_HUGEPAGE) // advice: without it, 4 KiB pages
	}
	// A child forked (not vforked, as os/exec does) would otherwise get a
	// copy of every pinned page: the kernel copies pinned pages at fork.
	_ = unix.Madvise(mem, unix.MADV_DONTFORK)
	start := time.Now()
	Populate(mem, 0)
	populated := time.Now()
	reg, err := dev.RegisterHost(mem)
	if err != nil {
		// A driver without cuMemHostRegister, or one refusing it (a
		// locked-memory limit, say), may still allocate pinned memory
		// itself.
		unix.Munmap(mem)
		slog.Debug("staging: registering a pinned buffer failed; allocating it with cuMemAllocHost", "size", n, "err", err)
		hb, aerr := dev.AllocHost(n)
		if aerr != nil {
			return nil, nil, errors.Join(aerr, fmt.Errorf("cuMemHostRegister before it: %w", err))
		}
		return hb.Bytes(), hb.Free, nil
	}
	slog.Debug("staging: pinned buffer allocated", "size", n, "huge_pages", huge,
		"populate", populated.Sub(start), "register", time.Since(populated))
	return mem, sync.OnceValue(func() error {
		if err := reg.Unregister(); err != nil {
			return err
		}
		return unix.Munmap(mem)
	}), nil
}

// Populate faults in the pages of mem, a fresh private anonymous mapping,
// on workers goroutines at once (workers <= 0 means GOMAXPROCS): the
// kernel allocates and zeroes each page, which one thread does at a
// fraction of the machine's memory bandwidth. It uses MADV_POPULATE_WRITE
// (Linux 5.14+), else writes a zero byte to each page, which a fresh
// mapping holds anyway.
func Populate(mem []byte, workers int) {
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	steps := (len(mem) + populateStep - 1) / populateStep
	work := make(chan int, steps)
	for i := range steps {
		work <- i * populateStep
	}
	close(work)
	page := os.Getpagesize()
	var wg sync.WaitGroup
	for range min(workers, steps) {
		wg.Go(func() {
			for off := range work {
				b := mem[off:min(off+populateStep, len(mem))]
				if unix.Madvise(b, unix.MADV_POPULATE_WRITE) == nil {
					continue
				}
				for i := 0; i < len(b); i += page {
					b[i] = 0
				}
			}
		})
	}
	wg.Wait()
}
