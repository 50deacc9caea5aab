package cudaipc_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// roles are the helper processes the tests start by re-executing the test
// binary.
var roles = testutil.Roles{
	"exporter": roleExporter,
	"importer": roleImporter,
	"nodriver": roleNoDriver,

	"regionExporter": roleRegionExporter,
	"regionImporter": roleRegionImporter,

	"fdimporter": roleFDImporter,
	"fdexporter": roleFDExporter,

	"fdRegionImporter": roleFDRegionImporter,

	"timelineProducer": roleTimelineProducer,
	"piecesExporter":   rolePiecesExporter,
}

func TestMain(m *testing.M) {
	testutil.RunRole(roles)
	code := m.Run()
	if code == 0 {
		if l := cudaipc.LiveObjects(); l != (cudaipc.Live{}) {
			fmt.Fprintf(os.Stderr, "leaked objects at exit: %+v\n", l)
			code = 1
		}
	}
	os.Exit(code)
}
