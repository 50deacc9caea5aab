package store

// The daemon's side of a round trip, in process: a raw client (protocol.Conn,
// as a C or Python client would speak it) against Serve on a real socket.
// allocs/op counts the daemon's allocations and the raw client's few.
//
//	go test -run '^$' -bench ServerRoundTrip -benchmem ./store

import (
	"testing"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

func BenchmarkServerRoundTrip(b *testing.B) {
	_, path, _ := serve(b, Config{})
	rc := dialRaw(b, path)
	rc.put("rt", 4096, false)
	getRelease := func() {
		resp, files := rc.do(req(&storev1.GetRequest{Name: "rt", TimeoutMs: -1}))
		if code(resp) != storev1.Error_OK || len(files) > 0 {
			b.Fatalf("get: %v, %d files", resp.GetError(), len(files))
		}
		resp, _ = rc.do(req(&storev1.ReleaseRequest{LeaseId: resp.GetGet().GetLeaseId()}))
		wantCode(b, resp, storev1.Error_OK)
	}
	b.Run("stat", func(b *testing.B) {
		stat := req(&storev1.StatRequest{Name: "rt"})
		b.ReportAllocs()
		for b.Loop() {
			resp, _ := rc.do(stat)
			wantCode(b, resp, storev1.Error_OK)
		}
	})
	b.Run("get-release", func(b *testing.B) {
		resp, files := rc.do(req(&storev1.GetRequest{Name: "rt"}))
		rc.mapping(resp.GetGet().GetPlacement(), files) // the arena, sent once
		rc.do(req(&storev1.ReleaseRequest{LeaseId: resp.GetGet().GetLeaseId()}))
		b.ReportAllocs()
		for b.Loop() {
			getRelease()
		}
	})
}
