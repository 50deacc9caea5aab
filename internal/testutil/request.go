package testutil

import (
	"fmt"

	"github.com/cudaipc/cudaipc/protocol/storev1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Request wraps body, an operation's message such as a
// *storev1.CreateRequest, in a storev1.Request (id 0) whose body holds it.
// It panics when the request has no body of body's type.
func Request(body proto.Message) *storev1.Request {
	r := &storev1.Request{}
	m := r.ProtoReflect()
	want := body.ProtoReflect().Descriptor().FullName()
	fields := m.Descriptor().Oneofs().ByName("body").Fields()
	for i := range fields.Len() {
		if f := fields.Get(i); f.Message() != nil && f.Message().FullName() == want {
			m.Set(f, protoreflect.ValueOfMessage(body.ProtoReflect()))
			return r
		}
	}
	panic(fmt.Sprintf("storev1.Request has no body of type %s", want))
}
