package store

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
)

// BenchmarkGPUPutWork is the daemon's own work for a put of a 1 GiB GPU
// object (create with its placement, seal) and its deletion, by legacy IPC
// and by descriptor, with kept arenas: no socket, no client. It reports
// each step's mean in µs (create-us, seal-us, delete-us), the part of a
// client's put that is not the round trip or the copy.
func BenchmarkGPUPutWork(b *testing.B) {
	dev := testutil.RequireGPU(b)
	gpu := dev.UUID().String()
	const size = 1 << 30
	for _, share := range []string{GPUShareIPC, GPUShareFD} {
		b.Run(share, func(b *testing.B) {
			if share == GPUShareFD && !dev.VMMFDSupported() {
				b.Skip("the GPU cannot export memory as file descriptors")
			}
			s := newTestStore(b, Config{Backend: "cuda", GPUShare: share, Capacity: 4 << 30})
			ss, err := s.newSession(context.Background(), peer{pid: int32(os.Getpid()), uid: 1000, gid: 1000})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { ss.close(errSessionClosed) })
			var create, seal, del time.Duration
			step := func(name string) {
				t0 := time.Now()
				p, err := ss.createObject(name, size, gpu, false)
				if err != nil {
					b.Fatal(err)
				}
				p.closeShare()
				t1 := time.Now()
				if err := ss.sealName(name); err != nil {
					b.Fatal(err)
				}
				t2 := time.Now()
				if err := ss.delete(name); err != nil {
					b.Fatal(err)
				}
				t3 := time.Now()
				create, seal, del = create+t1.Sub(t0), seal+t2.Sub(t1), del+t3.Sub(t2)
			}
			step("warm") // the first makes the arena
			create, seal, del = 0, 0, 0
			n := 0
			for b.Loop() {
				step("put")
				n++
			}
			us := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(n) }
			b.ReportMetric(us(create), "create-us")
			b.ReportMetric(us(seal), "seal-us")
			b.ReportMetric(us(del), "delete-us")
		})
	}
}
