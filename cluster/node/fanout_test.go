package node_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
)

// Four daemons get one object at once: their pulls fan out (each replica
// being pulled feeds the next reader), and every get sees the publisher's
// bytes. Whether a reader read from a feeder depends on how the pulls
// overlap on loopback; the bound on transfers is TestFanoutOverLimitedLinks'.
func TestDaemonsFanOut(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	var readers []*daemon
	for _, name := range []string{"b", "c", "d", "e"} {
		readers = append(readers, startDaemon(t, srv, name))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	want := a.put(t, "ns/fanned", 24<<20+5, client.CreateOptions{Cluster: true})
	errs := make([]error, len(readers))
	got := make([][]byte, len(readers))
	var wg sync.WaitGroup
	for i, d := range readers {
		wg.Go(func() { got[i], errs[i] = d.get(ctx, "ns/fanned") })
	}
	wg.Wait()
	var fed uint64
	for i, d := range readers {
		if errs[i] != nil {
			t.Fatalf("get on %s: %v", d.name, errs[i])
		}
		if !bytes.Equal(got[i], want) {
			t.Fatalf("get on %s: bytes differ", d.name)
		}
		st := d.node.Stats()
		fed += st.FedBytes
		if st.Pulls != 1 || st.Failed != 0 {
			t.Errorf("%s: %+v", d.name, st)
		}
	}
	t.Logf("bytes read from feeders: %d of %d", fed, 4*len(want))
	ls, err := a.node.Directory().List(ctx)
	if err != nil || len(ls) != 1 || len(ls[0].Holders) != 5 {
		t.Fatalf("directory: %+v %v", ls, err)
	}
	// A later get on a reader is local; a delete goes everywhere.
	if err := readers[0].c.Delete(ctx, "ns/fanned"); err != nil {
		t.Fatal(err)
	}
	for _, d := range append(readers, a) {
		eventually(t, 10*time.Second, "replica on "+d.name+" dropped", func() bool {
			_, err := d.c.Stat(ctx, "ns/fanned")
			return err != nil
		})
	}
}
