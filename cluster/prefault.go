package cluster

import (
	"os"
	"reflect"
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

// prefault maps in the pages of dst, the fresh mapping of a local replica,
// in order and ahead of the GETs that fill it, on a goroutine of its own
// (madvise MADV_POPULATE_WRITE, Linux 5.14+; elsewhere it does nothing).
// Without it every page of a new replica is allocated, zeroed and mapped
// by a page fault taken inside UCX's copy into dst, one 4 KiB page at a
// time on the pull's critical path; with it the zeroing runs beside the
// transfer. It never changes dst's contents: a page already written stays
// as it is. stop ends it and waits, so that dst may be unmapped afterwards;
// it is idempotent.
func prefault(dst []byte) (stop func()) {
	if len(dst) < prefaultMin {
		return func() {}
	}
	var stopped atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		page := os.Getpagesize()
		for off := 0; off < len(dst) && !stopped.Load(); off += prefaultStep {
			b := dst[off:min(off+prefaultStep, len(dst))]
			// madvise takes a page-aligned start: skip to the first page
			// boundary inside b (the pages before it fault as usual).
			if skip := (page - int(reflect.ValueOf(b).Pointer()%uintptr(page))) % page; skip < len(b) {
				b = b[skip:]
			} else {
				continue
			}
			if err := unix.Madvise(b, unix.MADV_POPULATE_WRITE); err != nil {
				return // EINVAL before Linux 5.14: the GETs fault the pages in
			}
		}
	}()
	return sync.OnceFunc(func() {
		stopped.Store(true)
		<-done
	})
}
