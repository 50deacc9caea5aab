package cli

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// TestExitCodesByClass: a store failure as the client decodes it from
// each error code exits with its class's code, also as explain rewords it,
// and the line says what to do; an error of several classes exits with the
// first of exitClasses. (TestFailuresAreOneLine runs the binary against a
// daemon for NOT_FOUND and TIMEOUT.)
func TestExitCodesByClass(t *testing.T) {
	for _, c := range []struct {
		code storev1.Error_Code
		exit int
		want string
	}{
		{storev1.Error_UNAVAILABLE, ExitUnavailable, "retry later"},
		{storev1.Error_DATA_LOSS, ExitDataLoss, "retrying does not help"},
		{storev1.Error_NOT_FOUND, ExitNotFound, "no such object"},
		{storev1.Error_TIMEOUT, ExitTimeout, "timed out"},
		{storev1.Error_STORE_FULL, ExitStoreFull, "store is full"},
		{storev1.Error_EXISTS, 1, "exists"},
		{storev1.Error_INTERNAL, 1, "internal error"},
	} {
		resp := protocol.ErrorResponse(5, protocol.Errorf(c.code, "pull 1000:w: detail"))
		err := explain(&client.Error{Op: "get", Name: "w", Err: protocol.Sentinel(resp.GetError().GetCode()), Message: resp.GetError().GetMessage()}, "/s")
		line := Message(err)
		if got := ExitCode(err); got != c.exit || !strings.Contains(line, c.want) {
			t.Errorf("%v: exit %d, %q; want exit %d and %q", c.code, got, line, c.exit, c.want)
		}
		if got := ExitCode(fmt.Errorf("get: %w", err)); got != c.exit {
			t.Errorf("%v wrapped: exit %d, want %d", c.code, got, c.exit)
		}
	}
	both := errors.Join(&client.Error{Op: "delete", Name: "a", Err: client.ErrNotFound}, &client.Error{Op: "delete", Name: "b", Err: client.ErrUnavailable})
	if got := ExitCode(both); got != ExitUnavailable {
		t.Errorf("not found and unavailable: exit %d, want %d", got, ExitUnavailable)
	}
	if got := ExitCode(&ExitError{Code: 2, Err: client.ErrNotFound}); got != 2 {
		t.Errorf("an ExitError's own code: %d", got)
	}
}
