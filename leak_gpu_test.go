package cudaipc_test

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestDroppedObjectsAreReleased: every owned type has a cleanup backstop.
// Objects dropped without Close or Free are released once collected, and
// the live counts return to where they were.
func TestDroppedObjectsAreReleased(t *testing.T) {
	dev := testutil.RequireGPU(t)
	before := cudaipc.LiveObjects()
	func() {
		s, err := dev.NewStream()
		if err != nil {
			t.Fatal(err)
		}
		e, err := dev.NewIPCEvent()
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Record(s); err != nil {
			t.Fatal(err)
		}
		b, err := dev.Alloc(1 << 20)
		if err != nil {
			t.Fatal(err)
		}
		h, err := dev.AllocHost(4096)
		if err != nil {
			t.Fatal(err)
		}
		sb, err := dev.AllocShareable(1)
		if err != nil {
			t.Fatal(err)
		}
		_, _, _, _, _ = s, e, b, h, sb
	}()
	during := cudaipc.LiveObjects()
	if during.Streams != before.Streams+1 || during.Events != before.Events+1 || during.Buffers != before.Buffers+1 ||
		during.HostBuffers != before.HostBuffers+1 || during.ShareableBuffers != before.ShareableBuffers+1 {
		t.Fatalf("live before %+v, with the objects %+v", before, during)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		runtime.GC()
		if now := cudaipc.LiveObjects(); now != before {
			return fmt.Errorf("live before %+v, after dropping and collecting %+v", before, now)
		}
		return nil
	})
	// The device still works: nothing was destroyed twice.
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
}
