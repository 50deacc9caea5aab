package node_test

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestWaitedReplicaAdvertised: a replica pulled for a get that waits
// (newer_than, and a plain get of a name created later) becomes a holder in
// the directory, though the get ends as soon as the replica is sealed. The
// advertisement must not share the get's end: a cancelled write left the
// replica local and unadvertised for good.
func TestWaitedReplicaAdvertised(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 2*time.Minute)
	for round := range 3 {
		name := fmt.Sprintf("policy-%d", round)
		v1, s1 := a.publish(t, name, 1, 3<<20+round)
		ver, got, err := b.getVersion(ctx, name, client.GetOptions{})
		if err != nil || ver != v1 || !bytes.Equal(got, s1[0]) {
			t.Fatalf("round %d: latest on B: v%d %v (want v%d)", round, ver, err, v1)
		}
		type result struct {
			ver  uint64
			data []byte
			err  error
		}
		res := make(chan result, 1)
		go func() {
			v, d, err := b.getVersion(ctx, name, client.GetOptions{NewerThan: v1, Wait: true})
			res <- result{v, d, err}
		}()
		waitingGets(t, b, 1)
		v2, s2 := a.publish(t, name, 1, 3<<20+round+7)
		r := <-res
		if r.err != nil || r.ver != v2 || !bytes.Equal(r.data, s2[0]) {
			t.Fatalf("round %d: newer than v%d on B: v%d %v (want v%d)", round, v1, r.ver, r.err, v2)
		}
		testutil.Eventually(t, testutil.Wait, func() error {
			e, err := a.node.Directory().Lookup(ctx, cluster.Ref{Name: name, Version: v2})
			if err != nil {
				return err
			}
			if len(e.Holders) != 2 {
				return errors.New("B is not a holder of the version it waited for: " + strings.Join(e.Holders, ","))
			}
			return nil
		})
		if b.logged("replica not advertised") {
			t.Fatalf("round %d: B logged a replica it did not advertise", round)
		}
	}
}
