package node_test

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
)

// Small objects come whole in the holder's answer on the control channel
// (cluster.MaxInline). The holder deletes each object while another node
// reads it and creates the next one, of the same size, so the deleted
// object's memory is reused: every get that succeeds returns exactly its
// own object's bytes, never a mix or the next object's, and the reads
// went inline.
func TestInlineReadRacesDeleteAndReuse(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 90*time.Second)
	const size, rounds = 8 << 10, 300
	type made struct {
		name string
		want []byte
	}
	objs := make(chan made)
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(objs)
		for i := range rounds {
			name := fmt.Sprintf("ns/r%d", i)
			o, err := a.c.Create(ctx, name, size, client.CreateOptions{Cluster: true})
			if err != nil {
				t.Errorf("create %s: %v", name, err)
				return
			}
			_, _ = rand.Read(o.Bytes())
			want := bytes.Clone(o.Bytes())
			if err := o.Seal(ctx); err != nil {
				t.Errorf("seal %s: %v", name, err)
				return
			}
			objs <- made{name, want}
			time.Sleep(time.Duration(i%4) * 300 * time.Microsecond) // the delete lands before, during or after the read
			if err := a.c.Delete(ctx, name); err != nil {
				t.Errorf("delete %s: %v", name, err)
				return
			}
		}
	})
	var got, failed int
	for m := range objs {
		l, err := b.c.Get(ctx, m.name)
		if err != nil {
			failed++
			continue
		}
		ok := bytes.Equal(l.Bytes(), m.want)
		l.Release()
		if !ok {
			t.Fatalf("get of %s returned bytes that are not its own", m.name)
		}
		got++
	}
	wg.Wait()
	st := b.node.Stats()
	t.Logf("%d gets read their object whole, %d failed as it was deleted; %d inline pulls", got, failed, st.Inline)
	if got == 0 || st.Inline == 0 {
		t.Fatalf("%d gets, %d inline pulls", got, st.Inline)
	}
}
