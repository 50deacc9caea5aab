package cluster

import (
	"os"
	"reflect"
	"runtime"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// prefaultStep is how much of a replica one madvise call maps in: small
// enough that stop returns soon, large enough that the calls cost nothing.
const prefaultStep = 4 << 20

// prefaultMin is the smallest replica worth a goroutine: below it the GETs'
// own page faults cost less.
const prefaultMin = 16 << 20

// prefaultWorkers is how many goroutines map a replica in: one goroutine
// zeroes and maps shared memory slower than a fast link delivers it, so a
// quarter of the CPUs, up to 4, keeps ahead of the reads and leaves a small
// machine one (docs/lab/cluster-measured.md, "Checks beside the reads").
func prefaultWorkers() int { return min(max(runtime.GOMAXPROCS(0)/4, 1), 4) }

// prefault maps in the pages of dst, the fresh mapping of a local replica,
// in order and ahead of the GETs that fill it, on goroutines of its own
// (prefaultWorkers of them, each taking the next prefaultStep in turn;
// madvise MADV_POPULATE_WRITE, Linux 5.14+; elsewhere it does nothing).
// Without it every page of a new replica is allocated, zeroed and mapped
// by a page fault taken inside UCX's copy into dst, one 4 KiB page at a
// time on the pull's critical path; with it the zeroing runs beside the
// transfer. It never changes dst's contents: a page already written stays
// as it is. stop ends it and waits, so that dst may be unmapped afterwards;
// it is idempotent.
func prefault(dst []byte) (stop func()) { return prefaultWith(dst, prefaultWorkers()) }

func prefaultWith(dst []byte, workers int) (stop func()) {
	if len(dst) < prefaultMin {
		return func() {}
	}
	var (
		stopped atomic.Bool
		next    atomic.Int64 // the next step's offset
		wg      sync.WaitGroup
	)
	page := os.Getpagesize()
	for range max(workers, 1) {
		wg.Go(func() {
			for !stopped.Load() {
				off := int(next.Add(prefaultStep) - prefaultStep)
				if off >= len(dst) {
					return
				}
				b := dst[off:min(off+prefaultStep, len(dst))]
				// madvise takes a page-aligned start: skip to the first
				// page boundary inside b (the pages before it fault as
				// usual).
				skip := (page - int(reflect.ValueOf(b).Pointer()%uintptr(page))) % page
				if skip >= len(b) {
					continue
				}
				if err := unix.Madvise(b[skip:], unix.MADV_POPULATE_WRITE); err != nil {
					stopped.Store(true) // EINVAL before Linux 5.14: the GETs fault the pages in
					return
				}
			}
		})
	}
	return sync.OnceFunc(func() {
		stopped.Store(true)
		wg.Wait()
	})
}
