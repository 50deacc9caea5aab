package testutil

import (
	"testing"

	"github.com/cudaipc/cudaipc/protocol/storev1"
	"google.golang.org/protobuf/proto"
)

// TestRequest: each body lands in its own case of the request's oneof, and
// a message that is no request body panics.
func TestRequest(t *testing.T) {
	create := &storev1.CreateRequest{Name: "x", Size: 7}
	if got := Request(create).GetCreate(); got != create {
		t.Errorf("create body = %v, want %v", got, create)
	}
	release := &storev1.ReleaseRequest{LeaseId: 3}
	if r := Request(release); r.GetRelease() != release || r.GetCreate() != nil || r.GetId() != 0 {
		t.Errorf("release request = %v", r)
	}
	want := &storev1.Request{Body: &storev1.Request_Hello{Hello: &storev1.HelloRequest{Version: 1}}}
	if got := Request(&storev1.HelloRequest{Version: 1}); !proto.Equal(got, want) {
		t.Errorf("hello request = %v, want %v", got, want)
	}
	defer func() {
		if recover() == nil {
			t.Error("a response as a request's body did not panic")
		}
	}()
	Request(&storev1.SealResponse{})
}
